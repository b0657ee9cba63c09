"""Real quantized kernels: torchao (int8 dynamic / weight-only / static, fp8) and bitsandbytes LLM.int8."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..errors import InputError, MissingDependency
from ..models.swap import replace_module
from .formats import BackendState, Format, Manifest, Written
from .heap import trim
from .mitigate import Calibrate, mitigate
from .schemes import BnbScheme, TensorQuant, TorchaoScheme, TorchaoStaticScheme, handles
from .simulate import ActQuant
from .sites import kept_linears, quantizable_linears

__all__ = ["apply_torchao", "apply_torchao_static", "apply_bnb", "TorchaoStaticState", "TORCHAO", "BITSANDBYTES"]

log = logging.getLogger("quantgate")
T = TypeVar("T", bound=TorchaoScheme)

# the attribute of a static-quantized Linear holding the rank of its inputs (nn.Module's __setattr__ is typed
# for tensors and modules only, so it is set with setattr)
_INPUT_NDIM = "qg_input_ndim"


def _quantize_(scheme: TorchaoScheme) -> Callable[..., None]:
    """torchao's ``quantize_``, or an error saying how to install torchao."""
    try:
        from torchao.quantization import quantize_  # torchao is optional: imported at first use, for the hint below
    except ImportError as e:
        raise MissingDependency(f"{scheme.name} needs torchao (pip install 'torchao>=0.18,<0.19'): {e}") from None
    return quantize_


# the torchao configs whose transformers serialization (TorchAoConfig) was checked here: saved as a torchao export
TORCHAO_EXPORTED = ("Int8DynamicActivationInt8WeightConfig", "Int8WeightOnlyConfig", "Float8WeightOnlyConfig")


def _torchao_export(model: nn.Module, scheme: TorchaoScheme) -> tuple[str, str]:
    if scheme.config in TORCHAO_EXPORTED:
        return TORCHAO.name, ""
    return "quantgate", f"transformers' torchao serialization is not checked here for {scheme.config}"


def _torchao_write(model: nn.Module, scheme: TorchaoScheme, dtype: torch.dtype | None) -> Written:
    """The model's state dict as transformers' torchao serialization stores it, with the matching ``TorchAoConfig``
    as config.json's quantization config."""
    from transformers import TorchAoConfig

    config = TorchAoConfig(quant_type=scheme.torchao_config(), modules_to_not_convert=kept_linears(model, scheme))
    return Written(model.state_dict(), config.to_dict())


# transformers' torchao serialization, which transformers, lm-eval and vLLM load
TORCHAO = Format("torchao", write=_torchao_write)


@handles(
    TorchaoScheme,
    restore=lambda model, scheme, manifest: apply_torchao(model, scheme, None),
    export=_torchao_export,
    formats=(TORCHAO,),
    assign=True,
)
def apply_torchao(model: nn.Module, scheme: TorchaoScheme, calibrate: Calibrate | None) -> nn.Module:
    """torchao's ``quantize_`` with the scheme's config on every Linear but the kept ones."""
    scheme = _mitigate(model, scheme, calibrate)
    quantize_, config = _quantize_(scheme), scheme.torchao_config()
    for _, linear in quantizable_linears(model, scheme):  # one at a time, the heap's free pages given back
        quantize_(model, config, filter_fn=lambda m, fqn, linear=linear: m is linear)
        trim()
    return model


@dataclass(frozen=True)
class TorchaoStaticState(BackendState):
    """torchao's static int8 in the manifest: per Linear, the rank of its inputs, which its calibrated input scale
    has (the scales themselves are in the weights file)."""

    input_ndims: dict[str, int]

    @classmethod
    def of(cls, model: nn.Module) -> TorchaoStaticState:
        return cls({n: getattr(m, _INPUT_NDIM) for n, m in model.named_modules() if hasattr(m, _INPUT_NDIM)})


def restore_torchao_static(model: nn.Module, scheme: TorchaoStaticScheme, manifest: Manifest) -> nn.Module:
    """The static layout with placeholder scales of the ranks the backend's state records."""
    state = manifest.state
    if not isinstance(state, TorchaoStaticState):
        raise InputError(f"{scheme}: the manifest holds no input ranks (field 'state'); save the quantized model again")
    return _with_input_scales(model, scheme, {n: torch.ones((1,) * d) for n, d in state.input_ndims.items()})


def _torchao_static_export(model: nn.Module, scheme: TorchaoStaticScheme) -> tuple[str, str]:
    why = "torchao's static int8 holds one calibrated input scale per Linear, which TorchAoConfig does not"
    return "quantgate", why


@handles(
    TorchaoStaticScheme,
    restore=restore_torchao_static,
    export=_torchao_static_export,
    state=TorchaoStaticState,
    assign=True,
)
def apply_torchao_static(model: nn.Module, scheme: TorchaoStaticScheme, calibrate: Calibrate) -> nn.Module:
    """torchao's static int8 on every Linear but the kept ones, with per-tensor symmetric activation
    scales (max |x| / 127) from the calibration batches."""
    scheme = _mitigate(model, scheme, calibrate)
    linears = quantizable_linears(model, scheme)
    spec = TensorQuant("int8", "tensor", symmetric=True, estimator="minmax")
    observers = {name: ActQuant(spec, f"{name} input") for name, _ in linears}
    handles_: list[RemovableHandle] = [
        linear.register_forward_pre_hook(_observe_input(observers[name])) for name, linear in linears
    ]
    calibrate(model)
    for h in handles_:
        h.remove()
    scales = {}
    for name, q in observers.items():
        assert q.observer is not None  # still calibrating: never frozen
        lo, hi = q.observer.range("int8", True)  # raises unless calibration data reached the Linear
        assert q.ndim is not None  # set by the calibration data that reached it
        scales[name] = (torch.maximum(lo.abs(), hi.abs()) / 127).clamp_min(1e-12).reshape((1,) * q.ndim)
    return _with_input_scales(model, scheme, scales)


def _mitigate(model: nn.Module, scheme: T, calibrate: Calibrate | None) -> T:
    """The fixes every backend applies (:func:`~quantgate.quant.mitigate.mitigate`), before torchao quantizes
    the weights; returns the scheme with the modules they keep named. Not when restoring a saved model
    (``calibrate`` None), whose weights and norms come smoothed from the file."""
    return mitigate(model, scheme, calibrate) if calibrate is not None else scheme


def _with_input_scales(model: nn.Module, scheme: TorchaoStaticScheme, scales: dict[str, torch.Tensor]) -> nn.Module:
    quantize_ = _quantize_(scheme)
    for name, linear in quantizable_linears(model, scheme):
        scale = scales[name].to(linear.weight.device)
        quantize_(linear, scheme.torchao_config(scale), filter_fn=lambda m, fqn, linear=linear: m is linear)
        setattr(linear, _INPUT_NDIM, int(scale.dim()))
        trim()
    return model


def _observe_input(quant: ActQuant):
    def hook(module, args):
        quant(args[0])  # calibrating: records the range, returns the input unchanged

    return hook


def restore_bnb(model: nn.Module, scheme: BnbScheme, manifest: Manifest | None = None) -> nn.Module:
    """Empty Linear8bitLt modules in place of the Linears (their int8 weights come from the file)."""
    return apply_bnb(model, scheme, None, skeleton=True)


def _bnb_write(model: nn.Module, scheme: BnbScheme, dtype: torch.dtype | None) -> Written:
    """The model's state dict as transformers' 8-bit serialization stores it, with ``BitsAndBytesConfig``."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_8bit=True, llm_int8_threshold=scheme.threshold, llm_int8_skip_modules=kept_linears(model, scheme)
    )
    return Written(model.state_dict(), config.to_dict())


# transformers' bitsandbytes 8-bit serialization
BITSANDBYTES = Format("bitsandbytes", write=_bnb_write)


@handles(BnbScheme, restore=restore_bnb, export=lambda model, scheme: (BITSANDBYTES.name, ""), formats=(BITSANDBYTES,))
def apply_bnb(
    model: nn.Module, scheme: BnbScheme, calibrate: Calibrate | None = None, *, skeleton: bool = False
) -> nn.Module:
    """Replace every Linear but the kept ones with bitsandbytes' Linear8bitLt (LLM.int8, outlier threshold)."""
    try:
        import bitsandbytes as bnb  # bitsandbytes is optional and heavy: imported at first use
    except ImportError as e:
        raise MissingDependency(f"llm-int8 needs bitsandbytes (pip install 'bitsandbytes>=0.50'): {e}") from None
    for name, linear in quantizable_linears(model, scheme):
        new = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=scheme.threshold,
        )
        if not skeleton:
            new.load_state_dict(linear.state_dict())
        new = new.to(linear.weight.device)  # moving the weight to its device quantizes it to int8
        new.register_forward_pre_hook(_rows_in)
        new.register_forward_hook(_rows_out)
        replace_module(model, name, new)
    return model.eval()  # on CPU bitsandbytes quantizes activations only in eval mode


# bitsandbytes' int8 matmul takes 2-D or 3-D inputs (its row statistics broadcast wrongly over more dims);
# MLA's kv_b_proj gets (B, 1, N, C): such inputs pass as rows and come back in their shape
_LEADING = "qg_leading_shape"


def _rows_in(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    setattr(module, _LEADING, x.shape[:-1] if x.dim() > 3 else None)
    return (x.reshape(-1, x.shape[-1]), *args[1:]) if x.dim() > 3 else None


def _rows_out(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    leading = getattr(module, _LEADING, None)
    return out.reshape(*leading, out.shape[-1]) if leading is not None else None
