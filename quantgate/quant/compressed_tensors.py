"""compressed-tensors: the format of the simulated schemes it can express, on an ungated model (INT8 / INT4 weights
per tensor, channel or group, symmetric or not; FP8 E4M3 weights; INT8 or FP8 activations at every Linear input,
static per tensor (calibrated scales, and zero points where asymmetric) or dynamic per tensor or token; NVFP4
weights and activations, the activations' per-tensor scale static from the maximum over calibration batches, as
compressed-tensors and vLLM run NVFP4, where quantgate's simulation takes it from each tensor).

The weights are stored as integers, FP8 or packed FP4 codes, written by compressed-tensors' own compressors from
quantgate's scales, so that quantgate reads back its weights bit for bit; transformers loads the folder through its
CompressedTensorsHfQuantizer and vLLM serves it. The static activation ranges, which compressed-tensors rounds to
its scales, are the format's state in the manifest (:class:`CompressedTensorsState`), so that a reload quantizes
exactly as the saved model did. :data:`COMPRESSED_TENSORS` is the simulated backend's format entry
(:mod:`quantgate.quant.simulate` names it); :func:`not_held` says why a model is not one it holds.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn as nn

from ..errors import InputError, MissingDependency
from ..json_record import JsonRecord
from ..models.families import config_of, family_of
from ..models.record import drop_record
from .formats import Format, Written
from .imported import INSTALL
from .quantizers import INT_BITS, WEIGHT_QPARAMS
from .schemes import SimulatedScheme, TensorQuant
from .sites import quantizable_linears

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

__all__ = ["COMPRESSED_TENSORS", "CompressedTensorsState", "not_held", "CT_INSTALL"]

CT_INSTALL = INSTALL["compressed-tensors"][1]
NVFP4_RANGE = 448.0 * 6.0  # FP8 E4M3's largest block scale x FP4 E2M1's largest value
_QPARAM_SUFFIXES = ("_scale", "_zero_point", "_global_scale")


class _ActQuant(Protocol):
    """What is read here of a simulated Linear's input quantizer (:class:`~quantgate.quant.simulate.ActQuant`)."""

    spec: TensorQuant
    lo: torch.Tensor
    hi: torch.Tensor
    amax: torch.Tensor


@dataclass(frozen=True)
class CompressedTensorsState(JsonRecord):
    """The format's state in the manifest: each static activation quantizer's range ``[lo, hi]`` by Linear (NVFP4:
    the per-tensor weight scale and the activations' maximum), which compressed-tensors' scales round."""

    act_ranges: dict[str, list[float]] = field(default_factory=dict)


def not_held(model: nn.Module, s: SimulatedScheme) -> str:
    """Why compressed-tensors cannot hold ``model`` quantized with ``s`` ('' when it can)."""
    if s.acts != "linear-inputs":
        return (
            f"acts={s.acts} quantizes residual sums, norms, q/k/v and the softmax, where compressed-tensors "
            f"quantizes Linear inputs only"
        )
    if s.kv is not None:
        return (
            f"its KV cache is quantized with dynamic per-{s.kv.granularity} ranges, which compressed-tensors' "
            f"kv_cache_scheme (static per-tensor scales) is not"
        )
    if s.rotate != "none":
        return f"rotate={s.rotate} adds Hadamard rotations that transformers' model classes do not hold"
    if s.weight is None:
        return "its weights stay in float while activations are quantized, which compressed-tensors' readers refuse"
    if s.weight.format == "nvfp4" or (s.act is not None and s.act.format == "nvfp4"):
        if s.act is not None and s.act.format != s.weight.format:
            return "NVFP4 is exported with NVFP4 weights and activations (or weights alone)"
        if not all(hasattr(linear, WEIGHT_QPARAMS) for _, linear in quantizable_linears(model, s)):
            return "its NVFP4 weight scales are not known (loaded from quantgate's own format); quantize it again"
        if s.act is not None and not all(float(q.amax) > 0 for q in _act_quants(model, s)):
            return (
                "its NVFP4 activations have a static per-tensor scale in compressed-tensors, from their maximum "
                "over calibration batches, and none were run (quantize with calibration=...; the CLI does)"
            )
        return ""
    if s.weight.format in ("mxfp8", "mxfp4"):
        return (
            f"its {s.weight.format} block scales follow torchao's OCP rounding, which compressed-tensors' MX "
            f"formats were not checked against here"
        )
    if s.weight.format not in ("int8", "int4", "fp8-e4m3"):
        return (
            f"its weights are {s.weight.format}; compressed-tensors stores INT8, INT4, FP8 E4M3 and NVFP4 weights here"
        )
    if s.act is not None:
        if s.act.format not in ("int8", "fp8-e4m3"):
            return f"its activations are {s.act.format}; compressed-tensors quantizes them to INT8 or FP8 E4M3 here"
        if s.act.granularity == "channel":
            return "its activations have static per-channel ranges, which compressed-tensors' readers do not take"
    missing = [n for n, linear in quantizable_linears(model, s) if not hasattr(linear, WEIGHT_QPARAMS)]
    if missing:
        return (
            f"the scales of {missing[0]}'s weights are not known (a checkpoint saved in quantgate's own format "
            f"was loaded); quantize the float model again to export it"
        )
    return ""


def _act_quants(model: nn.Module, s: SimulatedScheme) -> list[_ActQuant]:
    return [cast(_ActQuant, linear.input_quant) for _, linear in quantizable_linears(model, s)]


def _ct_args(spec: TensorQuant, role: str, width: int) -> QuantizationArgs:
    """compressed-tensors' args for ``spec`` on a Linear of ``width`` inputs (quantgate's groups shrink to
    the width where it is smaller)."""
    from compressed_tensors.quantization import QuantizationArgs

    group = spec.granularity == "group"
    return QuantizationArgs(
        num_bits=INT_BITS.get(spec.format, 8),
        type="float" if spec.format == "fp8-e4m3" else "int",
        symmetric=spec.symmetric or spec.format == "fp8-e4m3",
        strategy=spec.granularity,
        group_size=min(spec.group_size, width) if group else None,
        dynamic=spec.dynamic if role == "act" else False,
    )


def _ct_format(s: SimulatedScheme) -> str:
    assert s.weight is not None  # _not_compressed_tensors refused the rest
    if s.weight.format == "nvfp4":
        return "nvfp4-pack-quantized"
    if s.weight.format == "fp8-e4m3":
        return "float-quantized"
    if s.act is not None:
        return "int-quantized"
    # weight-only: packed into int32, as vLLM's wNa16 kernels read them; transformers 5.24 mis-sizes the
    # packed zero points of asymmetric weights on load, so those stay one integer per int8
    return "pack-quantized" if s.weight.symmetric else "naive-quantized"


def _ct_schemes(model: nn.Module, s: SimulatedScheme) -> dict[str, QuantizationScheme]:
    """The compressed-tensors scheme of each quantized Linear of ``model``; Linears of equal schemes share
    one (named by their exact module names unless every quantized Linear shares it: then ``Linear``)."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    assert s.weight is not None  # _not_compressed_tensors refused the rest
    fmt = _ct_format(s)
    by_width: dict[int, list[str]] = {}
    for name, linear in quantizable_linears(model, s):
        by_width.setdefault(min(linear.in_features, s.weight.group_size), []).append(name)
    out: dict[str, QuantizationScheme] = {}
    if s.weight.format == "nvfp4":  # compressed-tensors' own preset: blocks of 16, FP8 E4M3 block scales
        preset = preset_name_to_scheme("NVFP4" if s.act is not None else "NVFP4A16", ["Linear"])
        return dict.fromkeys(by_width.get(16, []) + [n for w, ns in by_width.items() if w != 16 for n in ns], preset)
    for width, names in by_width.items():
        targets = ["Linear"] if len(by_width) == 1 else [f"re:^{re.escape(n)}$" for n in names]
        scheme = QuantizationScheme(
            targets=targets,
            weights=_ct_args(s.weight, "weight", width),
            input_activations=_ct_args(s.act, "act", width) if s.act is not None else None,
            format=fmt,
        )
        out.update(dict.fromkeys(names, scheme))
    return out


def _require_ct() -> None:
    try:
        import compressed_tensors  # noqa: F401  (optional: imported at first use, for the hint below)
    except ImportError as e:
        raise MissingDependency(f"writing or reading compressed-tensors checkpoints needs {CT_INSTALL}: {e}") from None


@torch.no_grad()
def _write(model: nn.Module, scheme: SimulatedScheme, dtype: torch.dtype | None = None) -> Written:
    """The state dict of ``model`` in compressed-tensors' layout (packed weights, ``weight_scale`` /
    ``weight_zero_point``, static ``input_scale`` / ``input_zero_point``), written by compressed-tensors' own
    compressors from quantgate's scales, with the tensors it leaves in full precision in ``dtype`` (None: the
    model's); the ``quantization_config`` config.json takes; and each static activation quantizer's range [lo,
    hi] as the format's state, which quantgate reads back so that a reload quantizes exactly as the saved model
    did."""
    _require_ct()
    import compressed_tensors
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    fmt = _ct_format(scheme)
    schemes = _ct_schemes(model, scheme)
    groups = {f"group_{i}": sch for i, sch in enumerate({id(sch): sch for sch in schemes.values()}.values())}
    quantized = dict(quantizable_linears(model, scheme))
    ignore = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized)
    qconfig = QuantizationConfig(
        config_groups=groups, ignore=ignore, format=fmt, quantization_status=QuantizationStatus.FROZEN
    )
    clone = _plain_copy(model)
    apply_quantization_config(clone, qconfig, show_progress=False)
    ranges: dict[str, list[float]] = {}
    for name, linear in quantized.items():
        target = clone.get_submodule(name)
        if fmt == "nvfp4-pack-quantized":
            ranges[name] = _copy_nvfp4(target, linear)
            continue
        scale, zero = getattr(linear, WEIGHT_QPARAMS)
        assert scheme.weight is not None  # _not_compressed_tensors refused weight-less schemes
        _copy_qparams(target, "weight", scale, zero, scheme.weight)
        if scheme.act is not None and not scheme.act.dynamic:
            quant = cast(_ActQuant, linear.input_quant)
            a_scale, a_zero = _act_qparams(quant)
            _copy_qparams(target, "input", a_scale, a_zero, scheme.act)
            ranges[name] = [float(quant.lo), float(quant.hi)]
    for name in quantized:  # ModelCompressor.compress_model, less its progress bar and decompression hook
        compress_module(clone.get_submodule(name), CompressionFormat(fmt))
    qconfig.quantization_status = QuantizationStatus.COMPRESSED
    config = {
        "quant_method": "compressed-tensors",
        "version": compressed_tensors.__version__,
        **qconfig.model_dump(exclude={"quant_method"}),
    }
    state = dict(clone.state_dict())
    if dtype is not None:  # the full-precision tensors: wider floats that are no quantization parameter
        cast_once: dict[int, torch.Tensor] = {}  # tied tensors (embedding and head) stay one tensor
        state = {
            k: cast_once.setdefault(v.data_ptr(), v.to(dtype)) if _full_precision(k, v) else v for k, v in state.items()
        }
    return Written(state, config, CompressedTensorsState(ranges) if ranges else None)


def _full_precision(key: str, t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() > 1 and not key.endswith(_QPARAM_SUFFIXES)


def _copy_nvfp4(target: nn.Module, linear: nn.Linear) -> list[float]:
    """NVFP4's scales of ``linear`` (as quantize_weight_qparams recorded them) into compressed-tensors'
    ``weight_scale`` (FP8 E4M3, one per block of 16), ``weight_global_scale`` (1 / the per-tensor scale)
    and, for the activations, ``input_global_scale`` (FP8 max x FP4 max / the calibrated maximum,
    compressed-tensors' formula); returns the per-tensor weight scale and the activations' maximum, which
    the manifest keeps for an exact reload."""
    block, tensor_scale = getattr(linear, WEIGHT_QPARAMS)
    target.weight_scale.data = block.reshape(target.weight_scale.shape).to(target.weight_scale.dtype)
    target.weight_global_scale.data = (1 / tensor_scale).reshape(target.weight_global_scale.shape).float()
    quant = getattr(linear, "input_quant", None)
    amax = float(cast(_ActQuant, quant).amax) if quant is not None else 0.0
    if hasattr(target, "input_global_scale"):
        gscale = cast(torch.Tensor, target.input_global_scale)
        gscale.data = torch.full_like(gscale, NVFP4_RANGE / amax)
    return [float(tensor_scale), amax]


def _nvfp4_weight(packed: torch.Tensor, scale: torch.Tensor, tensor_scale: float) -> torch.Tensor:
    """torchao's NVFP4 dequantization (codes x (FP8 block scale x per-tensor scale), float32) of
    compressed-tensors' packed codes: the weights quantgate saved, bit for bit."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    m, n = packed.shape[0], packed.shape[1] * 2
    codes = unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32).view(m, n // 16, 16)
    block = scale.to(torch.float32) * torch.tensor(tensor_scale, dtype=torch.float32)
    return (codes * block.view(m, n // 16, 1)).view(m, n)


def _plain_copy(model: nn.Module) -> nn.Module:
    """A model of ``model``'s transformers class with its weights (already on quantgate's grid) and none of
    quantgate's quantizers."""
    config = copy.deepcopy(config_of(model))
    drop_record(config)
    with torch.random.fork_rng(devices=[]):
        clone: nn.Module = family_of(model).model_class(config)(config)
    state = {k: v for k, v in model.state_dict().items() if not _is_quantizer_key(k)}
    clone.load_state_dict(state, strict=True)
    return clone.to(dtype=next(model.parameters()).dtype).eval()


def _is_quantizer_key(key: str) -> bool:
    return ".input_quant." in key or ".output_quant." in key or ".qg_fake_quant." in key


def _act_qparams(quant: _ActQuant) -> tuple[torch.Tensor, torch.Tensor]:
    from .quantizers import qparams

    return qparams(quant.lo, quant.hi, quant.spec.format, quant.spec.symmetric)


def _copy_qparams(target: nn.Module, base: str, scale: torch.Tensor, zero: torch.Tensor, spec: TensorQuant) -> None:
    """quantgate's (scale, zero) into compressed-tensors' ``{base}_scale`` / ``{base}_zero_point``: its
    integer grids are signed (-2^(b-1) .. 2^(b-1) - 1), so an asymmetric zero point shifts by 2^(b-1)."""
    ct_scale = getattr(target, f"{base}_scale")
    ct_scale.data = scale.to(ct_scale.dtype).reshape(ct_scale.shape).clone()
    ct_zero = getattr(target, f"{base}_zero_point", None)
    if ct_zero is not None:
        shift = 2 ** (INT_BITS[spec.format] - 1) if spec.format in INT_BITS and not spec.symmetric else 0
        ct_zero.data = (torch.round(zero) - shift).to(ct_zero.dtype).reshape(ct_zero.shape).clone()


@torch.no_grad()
def _read(
    model: nn.Module, scheme: SimulatedScheme, state: dict[str, torch.Tensor], saved: CompressedTensorsState | None
) -> dict[str, torch.Tensor]:
    """The state dict of quantgate's simulated skeleton ``model`` (its quantizers attached) from a
    compressed-tensors ``state`` that quantgate wrote: weights decompressed by compressed-tensors' own
    compressors, each static quantizer's range from the format's ``saved`` state. The weights' scales are
    attached to their Linears again, so the model can be exported once more."""
    _require_ct()
    from compressed_tensors.compressors import BaseCompressor

    schemes = _ct_schemes(model, scheme)
    compressor = BaseCompressor.get_value_from_registry(_ct_format(scheme))
    out = dict(state)
    ranges = saved.act_ranges if saved is not None else {}
    nvfp4 = ranges if _ct_format(scheme) == "nvfp4-pack-quantized" else {}
    for name, linear in quantizable_linears(model, scheme):
        local = {k.removeprefix(f"{name}."): out.pop(k) for k in list(out) if k.startswith(f"{name}.")}
        extra = {k: local.pop(k) for k in list(local) if k.startswith("input_") or k == "bias"}
        if "bias" in extra:
            out[f"{name}.bias"] = extra["bias"]
        if name in nvfp4:
            tensor_scale, amax = nvfp4[name]
            out[f"{name}.weight"] = _nvfp4_weight(local["weight_packed"], local["weight_scale"], tensor_scale)
            block = local["weight_scale"].float()
            setattr(linear, WEIGHT_QPARAMS, (block, torch.tensor([tensor_scale], dtype=torch.float32)))
            if scheme.act is not None:
                quant = cast(_ActQuant, linear.input_quant)
                quant.amax = torch.tensor(amax, dtype=torch.float32, device=quant.amax.device)
                out |= {f"{name}.input_quant.{k}": torch.zeros(()) for k in ("lo", "hi")}
            continue
        dense = compressor.decompress(local, schemes[name])
        out[f"{name}.weight"] = dense["weight"].to(linear.weight.dtype)
        assert scheme.weight is not None
        scale = dense["weight_scale"].float()
        zero = dense.get("weight_zero_point")  # unpacked by the decompressor
        shift = 2 ** (INT_BITS[scheme.weight.format] - 1) if not scheme.weight.symmetric else 0
        zero_q = (zero.float() + shift) if zero is not None else torch.zeros_like(scale)
        setattr(linear, WEIGHT_QPARAMS, (scale, zero_q.reshape(scale.shape)))
        if scheme.act is not None:  # dynamic quantizers keep their (unused) zero range buffers
            if not scheme.act.dynamic and name not in ranges:
                raise InputError(f"quantization.json has no activation range for {name}; save the model again")
            lo, hi = ranges.get(name, (0.0, 0.0))
            out[f"{name}.input_quant.lo"] = torch.tensor(lo, dtype=torch.float32)
            out[f"{name}.input_quant.hi"] = torch.tensor(hi, dtype=torch.float32)
    return out


COMPRESSED_TENSORS = Format(
    "compressed-tensors", write=_write, read=_read, state=CompressedTensorsState, takes_dtype=True
)
