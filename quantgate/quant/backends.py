"""Real quantized kernels: torchao (int8 dynamic / weight-only / static, fp8) and bitsandbytes LLM.int8."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .schemes import Scheme, TensorQuant
from .simulate import ActQuant, quantizable_linears

__all__ = ["apply_torchao", "apply_bnb", "replace_module", "torchao_input_ndims"]

log = logging.getLogger("quantgate")


def _torchao_config(scheme: Scheme, static_scale: torch.Tensor | None = None):
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int8DynamicActivationInt8WeightConfig, Int8StaticActivationInt8WeightConfig,
                                      Int8WeightOnlyConfig)
    from torchao.quantization.granularity import PerRow, PerTensor

    if scheme.name == "torchao-int8-static":
        return Int8StaticActivationInt8WeightConfig(act_quant_scale=static_scale, granularity=[PerTensor(), PerRow()])
    return {"torchao-int8-dynamic": Int8DynamicActivationInt8WeightConfig,
            "torchao-int8-weight-only": Int8WeightOnlyConfig,
            "torchao-fp8-weight-only": Float8WeightOnlyConfig,
            "torchao-fp8-dynamic": Float8DynamicActivationFloat8WeightConfig}[scheme.name]()


def apply_torchao(model: nn.Module, scheme: Scheme, calibrate, *, skeleton: bool = False, ndims=None) -> nn.Module:
    """torchao's ``quantize_`` on every Linear but the kept ones. For int8 static, per-tensor symmetric
    activation scales (max |x| / 127) come from the calibration batches (``ndims`` and placeholder
    scales when only the structure is rebuilt for loading)."""
    try:
        from torchao.quantization import quantize_
    except ImportError as e:
        raise ModuleNotFoundError(f"{scheme.name} needs torchao (pip install 'torchao>=0.18,<0.19'): {e}") from None
    linears = quantizable_linears(model, scheme)
    if scheme.name != "torchao-int8-static":
        targets = {id(m) for _, m in linears}
        quantize_(model, _torchao_config(scheme), filter_fn=lambda m, fqn: id(m) in targets)
        return model
    observers = {}
    if not skeleton:
        spec = TensorQuant("int8", "tensor", symmetric=True, estimator="minmax")
        handles = []
        for name, linear in linears:
            observers[name] = ActQuant(spec, f"{name} input")
            handles.append(linear.register_forward_pre_hook(_observe_input(observers[name])))
        calibrate(model)
        for h in handles:
            h.remove()
    for name, linear in linears:
        if skeleton:
            scale = torch.ones((1,) * ndims[name])
        else:
            q = observers[name]
            lo, hi = q.observer.range("int8", True)
            scale = (torch.maximum(lo.abs(), hi.abs()) / 127).clamp_min(1e-12).reshape((1,) * q.ndim)
        quantize_(linear, _torchao_config(scheme, scale.to(linear.weight.device)), filter_fn=lambda m, fqn: m is linear)
        linear.qg_input_ndim = int(scale.dim())
    return model


def _observe_input(quant: ActQuant):
    def hook(module, args):
        quant(args[0])  # calibrating: records the range, returns the input unchanged
    return hook


def apply_bnb(model: nn.Module, scheme: Scheme, calibrate=None, *, skeleton: bool = False) -> nn.Module:
    """Replace every Linear but the kept ones with bitsandbytes' Linear8bitLt (LLM.int8, outlier threshold)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ModuleNotFoundError(f"llm-int8 needs bitsandbytes (pip install 'bitsandbytes>=0.50'): {e}") from None
    for name, linear in quantizable_linears(model, scheme):
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  has_fp16_weights=False, threshold=scheme.threshold)
        if not skeleton:
            new.load_state_dict(linear.state_dict())
        new = new.to(linear.weight.device)  # moving the weight to its device quantizes it to int8
        replace_module(model, name, new)
    return model.eval()  # on CPU bitsandbytes quantizes activations only in eval mode


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` was, keeping the old module's hooks (G2/G5 gates ride on them)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    new._forward_hooks.update(old._forward_hooks)
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    if "_qg_owner" in old.__dict__:
        object.__setattr__(new, "_qg_owner", old._qg_owner)
    setattr(parent, child, new)


def torchao_input_ndims(model: nn.Module) -> dict[str, int]:
    """Per Linear, the rank of its inputs recorded for torchao's static scales (saved in the manifest)."""
    return {n: m.qg_input_ndim for n, m in model.named_modules() if hasattr(m, "qg_input_ndim")}

