"""What a variant costs: gate parameters and gate FLOPs per token, measured against its vanilla twin; and how many
parameters a model holds, counted by storage (:func:`parameter_count`)."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ..json_record import JsonRecord
from .families import config_of, family_of
from .modes import eval_mode
from .record import set_record
from .swap import apply_variant, gate_parameters

__all__ = ["GateCost", "gate_cost", "parameter_count"]


@dataclass(frozen=True)
class GateCost(JsonRecord):
    """Parameters a variant adds (gates and sinks) and the matmul FLOPs per token they add to a forward pass
    (torch's FLOP counter: 2 per multiply-add; elementwise work such as the sigmoid is not counted)."""

    gate_params: int
    gate_flops_per_token: float


def _forward_flops(model: nn.Module, ids: torch.Tensor) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    return counter.get_total_flops()


def gate_cost(model: nn.Module, tokens: int = 32) -> GateCost:
    """What ``model``'s variant costs against the same model with plain attention, over ``tokens`` tokens. A family
    whose gate is built in (Qwen3-Next's, in the second half of each head's q_proj slice) has no plain-attention
    twin to run: its gate is counted as the q_proj rows that compute it, 2 FLOPs per weight per token."""
    family = family_of(model)
    if family.native_gate:
        rows = [cast(nn.Linear, b.get_submodule(family.q_proj)) for b in family.attention_blocks(model)]
        weights = sum(q.weight.numel() // 2 for q in rows)
        biases = sum(q.bias.numel() // 2 for q in rows if q.bias is not None)
        return GateCost(weights + biases, 2.0 * weights)
    config = copy.deepcopy(config_of(model))
    set_record(config, variant=None)
    device = next(model.parameters()).device
    twin = apply_variant(type(model)(config), "vanilla").to(device)
    ids = torch.randint(5, min(config.vocab_size, 200), (1, tokens), device=device)
    with eval_mode(model):
        extra = _forward_flops(model, ids) - _forward_flops(twin.eval(), ids)
    return GateCost(parameter_count(gate_parameters(model).values()), extra / tokens)


def parameter_count(params: nn.Module | Iterable[torch.Tensor]) -> int:
    """The parameters of a model (or of ``params``) by storage, not by Parameter object: tensors that share
    storage count once (a tied LM head, also where a loaded checkpoint holds it as a second Parameter over the
    embedding's storage), and a tensor subclass (torchao's quantized weights) counts its logical elements once,
    whatever its inner tensors (int8 data, scales) hold."""
    tensors = params.parameters() if isinstance(params, nn.Module) else params
    seen: set[Hashable] = set()
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel()
    return total


def _storage_key(t: torch.Tensor) -> Hashable:
    """What tells ``t``'s storage from another tensor's: the storage, offset, shape, strides and dtype of a plain
    tensor; the inner tensors' keys for a wrapper subclass; the object itself where there is no storage (meta)."""
    data = t.data if isinstance(t, nn.Parameter) else t
    if hasattr(data, "__tensor_flatten__"):  # a wrapper subclass (torchao's): its inner tensors hold the storage
        names, _ = data.__tensor_flatten__()
        return (type(data).__name__, tuple(_storage_key(getattr(data, n)) for n in names))
    try:
        if data.device.type == "meta":
            return ("object", id(t))
        storage = data.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
        return ("object", id(t))
    return (data.device, storage, data.storage_offset(), tuple(data.shape), data.stride(), data.dtype)
