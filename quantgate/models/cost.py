"""What a variant costs: gate parameters and gate FLOPs per token, measured against its vanilla twin."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .families import config_of
from .modes import eval_mode
from .swap import apply_variant, gate_parameters

__all__ = ["gate_cost"]


def _forward_flops(model: nn.Module, ids: torch.Tensor) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    return counter.get_total_flops()


def gate_cost(model: nn.Module, tokens: int = 32) -> dict:
    """``{"gate_params", "gate_flops_per_token"}``: parameters the variant added (gates and sinks), and
    the matmul FLOPs per token of a forward pass beyond those of the same model with plain attention
    (torch's FLOP counter: 2 per multiply-add; elementwise work such as the sigmoid is not counted).
    """
    config = copy.deepcopy(config_of(model))
    config.quantgate = {k: v for k, v in (config.quantgate or {}).items() if k != "variant"}
    device = next(model.parameters()).device
    twin = apply_variant(type(model)(config), "vanilla").to(device)
    ids = torch.randint(5, min(config.vocab_size, 200), (1, tokens), device=device)
    with eval_mode(model):
        extra = _forward_flops(model, ids) - _forward_flops(twin.eval(), ids)
    return {
        "gate_params": sum(p.numel() for p in gate_parameters(model).values()),
        "gate_flops_per_token": extra / tokens,
    }
