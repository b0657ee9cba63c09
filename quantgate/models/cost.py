"""What a variant costs: gate parameters and gate FLOPs per token, measured against its vanilla twin."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ..json_record import JsonRecord
from .families import config_of
from .modes import eval_mode
from .record import set_record
from .swap import apply_variant, gate_parameters

__all__ = ["GateCost", "gate_cost"]


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
    """What ``model``'s variant costs against the same model with plain attention, over ``tokens`` tokens."""
    config = copy.deepcopy(config_of(model))
    set_record(config, variant=None)
    device = next(model.parameters()).device
    twin = apply_variant(type(model)(config), "vanilla").to(device)
    ids = torch.randint(5, min(config.vocab_size, 200), (1, tokens), device=device)
    with eval_mode(model):
        extra = _forward_flops(model, ids) - _forward_flops(twin.eval(), ids)
    return GateCost(sum(p.numel() for p in gate_parameters(model).values()), extra / tokens)
