"""What a variant costs: gate parameters and gate FLOPs per token, measured against its vanilla twin; how many
parameters a model holds, counted by storage (:func:`parameter_count`); and whether a model fits in the memory free
where it would run (:func:`check_memory`, the one check the audit and a study's dry run make)."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import InputError
from ..json_record import JsonRecord
from .families import Family, config_of, family_of
from .io import DTYPES, meta_model
from .modes import eval_mode
from .record import set_record
from .swap import apply_variant, gate_parameters

__all__ = ["GateCost", "gate_cost", "parameter_count", "parameter_estimate", "free_memory", "check_memory"]

RUN_COPIES = 2.5  # a run holds the float model and a quantized copy, and a quarter more for the rest
TRAIN_COPIES = 4.5  # training here holds float32 weights, gradients, AdamW's two moments, and a half for activations
EXACT_LAYERS = 256  # up to this many layers the count is the meta model's; beyond, two layers' count extrapolated


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


def parameter_estimate(family: Family, config: Any) -> int:
    """The parameters ``family``'s model for ``config`` holds, counted on the meta device (no memory); a config of
    more than :data:`EXACT_LAYERS` layers is counted with one and two layers and the difference extrapolated (a
    hundred million layers would take minutes to build even on the meta device)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= EXACT_LAYERS:
        return sum(p.numel() for p in meta_model(family, config).parameters())
    one, two = (sum(p.numel() for p in meta_model(family, _layers(config, layers, n)).parameters()) for n in (1, 2))
    return one + (layers - 1) * (two - one)


def _layers(config: Any, layers: int, n: int) -> Any:
    """``config`` with ``n`` of its ``layers`` layers, its per-layer lists (``layer_types``) cut to match."""
    small = copy.copy(config)
    small.__dict__ = {
        k: (v[:n] if isinstance(v, (list, tuple)) and len(v) == layers else v) for k, v in config.__dict__.items()
    }
    small.num_hidden_layers = n
    return small


def free_memory() -> int:
    """Bytes a new model can take where quantgate runs it: the GPU's free memory where there is one, else the
    machine's (Linux's MemAvailable, else the free pages)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), flags=re.M)
        if found:
            return int(found.group(1)) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(
    name: str, family: Family, config: Any, dtype: str, fix: str, *, train: bool = False, error: type = InputError
) -> None:
    """Refuse (``error``, one line naming ``name``, the estimate and ``fix``) a model whose run does not fit in the
    memory free where it runs (:func:`free_memory`): a float and a quantized copy in ``dtype`` (:data:`RUN_COPIES`),
    or, where it trains here (``train``), float32 weights with their gradients and AdamW's moments
    (:data:`TRAIN_COPIES`), whichever is more."""
    params = parameter_estimate(family, config)
    need = int(params * DTYPES[dtype].itemsize * RUN_COPIES)
    what = f"a float and a quantized copy in {dtype} need"
    if train and params * 4 * TRAIN_COPIES > need:
        need = int(params * 4 * TRAIN_COPIES)
        what = "training it in float32 (weights, gradients, AdamW's moments) needs"
    free = free_memory()
    if need > free:
        raise error(
            f"{name} has {params / 1e9:,.2f} B parameters: {what} about {need / 2**30:,.1f} GiB and "
            f"{free / 2**30:,.1f} GiB are free here; {fix}"
        )
