"""Fast fake quantization onto small float grids (FP8 E4M3 / E5M2, FP4 E2M1) and the block-scaled formats
built on them (OCP MXFP8 / MXFP4, NVIDIA NVFP4), in plain float32 / int32 tensor ops that give torchao's
numbers bit for bit.

Why: torchao's emulation is exact but slow on a CPU. Its FP8 round trip casts through ``torch.float8_*``
(``aten::copy_``; float8_e4m3fn back to float32 alone takes ~2 ms for 0.5M values on one core here); its FP4
code (``kernels.f32_to_f4_unpacked`` and back) is some forty mask, shift and where passes. Every simulated FP8 /
FP4 / MX / NVFP4 scheme pays this on every activation of every forward.

How: rounding to a float grid of ``m`` mantissa bits, smallest normal exponent ``emin`` and largest value
``fmax`` is, for ``|v| <= fmax``, ``round(v / step) * step`` with ``step = 2 ** (max(floor(log2 |v|), emin) - m)``
(:func:`round_`): ``floor(log2 |v|)`` is the float32 exponent field of ``v``, so ``step`` is built as bits (the
exponent field, clamped below at ``emin``, minus ``m``) and viewed as float32; dividing and multiplying by a
power of two is exact, and ``torch.round`` rounds half to even, the rounding of the float8 casts and of
torchao's FP4 code. The grid's subnormals (``|v| < 2 ** emin``) share the step ``2 ** (emin - m)``; the sign of
zero survives (``round(-0.3) = -0.0``); NaN stays NaN. Saturation is a clamp to ``+-fmax`` (torchao clamps
before its FP8 casts; its FP4 code saturates at 6), left out where no value can round past ``fmax``. Six
elementwise passes, reusing the ``|x|`` buffer of the saturation count for the steps; all 2^32 float32 bit
patterns round as the casts do (checked once, exhaustively; tests/test_fast_quant.py holds every function to
torchao on every float32 exponent, ties, zeros, subnormals, saturation, NaN and inf). On 0.5M values, one core:
FP8 1.6 ms against torchao's 2.0 (e5m2) to 3.7 (e4m3), FP4 / MXFP4 / NVFP4 1.6-2.3 ms against 18-19, MXFP8 1.4
against 3.4. ``torch.compile`` was not used: it would fuse the passes, but each new activation shape costs
seconds of compilation, which short runs and the test suite would pay over and over.

Block-scaled formats (blocks along the last dim) reproduce torchao's arithmetic step by step, vectorised over
all blocks at once (the tensor viewed as (..., blocks, block)):

* MX (``MXTensor.to_mx``, FLOOR scale mode, then ``dequantize``): block scale ``2 ** e``, ``e`` = the exponent
  field of the block's max |x| minus 127 minus the element format's largest power of two (E4M3: 8, E2M1: 2),
  clamped to [-127, 127]; elements ``x / max(2 ** e, 2 ** -126)`` rounded with saturation; values the rounded
  elements times ``2 ** e`` (so a block of max |x| below ~2 ** -119 divides by 2 ** -126 and multiplies by
  2 ** -127, as torchao does), NaN for a block holding NaN.
* NVFP4 (``NVFP4Tensor.to_nvfp4`` with ``per_tensor_amax_to_scale``, then ``dequantize``): per-tensor scale
  ``t = max|x| / (448 * 6)``; per block of 16, FP8 E4M3 scale ``s = e4m3(clamp(max|x_block| / 6 / t, 2 ** -6,
  448))``; elements ``e2m1(clamp(x * ((1 / t) / s), -6, 6))``; values the elements times ``t * s``. Where
  those scales are not finite, :func:`nvfp4` runs torchao itself when it is installed: a tensor that is all
  zeros or holds inf or NaN (torchao's values are all NaN, as these would be), or whose max |x| is below
  ~1e-33 (torchao turns its zeros into 0 * inf = NaN elements and those into tiny nonzero values through its
  FP4 code of NaN; without torchao they stay NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from quantgate.errors import InputError

__all__ = ["Minifloat", "MINIFLOATS", "round_", "saturated_", "fake_minifloat", "fake_mx", "nvfp4"]


class Minifloat(NamedTuple):
    """A small float format: mantissa bits, exponent of the smallest normal value, largest magnitude."""

    mbits: int
    emin: int
    fmax: float


MINIFLOATS = {
    "fp8-e4m3": Minifloat(3, -6, 448.0),  # torch.float8_e4m3fn
    "fp8-e5m2": Minifloat(2, -14, 57344.0),  # torch.float8_e5m2
    "fp4-e2m1": Minifloat(1, 0, 6.0),  # OCP E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6
}
MX_MAX_POW2 = {"fp8-e4m3": 8, "fp4-e2m1": 2}  # the largest power of two of an MX element format (256, 4)
F32_EXP = 0x7F800000  # the exponent field of a float32
F32_MANT = 23  # its mantissa bits
F32_BIAS = 127
E4M3_TINY = 2.0**-6  # NVFP4 block scales: torchao clamps them to the smallest normal FP8 E4M3 value
NVFP4_BLOCK = 16


def round_(y: torch.Tensor, fmt: str, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``y`` (any shape) in place to the nearest value of the float format ``fmt``
    (``MINIFLOATS``), ties to even: for ``|y| <= fmax`` and NaN, the numbers of a cast to
    ``torch.float8_e4m3fn`` / ``float8_e5m2`` and back, or of torchao's ``f32_to_f4_unpacked`` then
    ``f4_unpacked_to_f32`` (but NaN stays NaN); above ``fmax`` the grid goes on upward (clamp first to
    saturate). ``buf``: a float32 tensor of ``y``'s shape to hold the steps (overwritten), or None to allocate
    one. Returns ``y``."""
    m = MINIFLOATS[fmt]
    out = None if buf is None else buf.view(torch.int32)
    step = torch.bitwise_and(y.view(torch.int32), F32_EXP, out=out)  # 2 ** floor(log2 |y|) as bits
    step.clamp_(min=(m.emin + F32_BIAS) << F32_MANT).sub_(m.mbits << F32_MANT)
    s = step.view(torch.float32)
    return y.div_(s).round_().mul_(s)


def saturated_(a: torch.Tensor, limit: torch.Tensor) -> tuple[int, bool]:
    """(number of values with ``a > limit``, whether ``a`` is all finite and ``limit`` all finite and positive)
    for ``a = |x|`` (float32, overwritten when the count is taken) and ``limit`` broadcasting against it.
    One max pass over ``a``; the exact count (two more passes) only where max |x| passes the smallest limit or
    is not finite: 1.0 / 0.0 written over ``a`` in place and summed, exact in float32 below 2 ** 24 values."""
    least = limit.min()
    valid = (least > 0) & limit.isfinite().all()
    if not a.numel():
        return 0, bool(valid)
    amax = a.amax()  # NaN where x holds NaN
    under, finite = torch.stack((amax <= least, amax.isfinite() & valid)).tolist()
    if under:
        return 0, finite
    if a.numel() < 2**24 and torch.broadcast_shapes(a.shape, limit.shape) == a.shape:
        return int(a.gt_(limit).sum()), finite
    return int(torch.count_nonzero(a > limit)), finite


def _scaled(x: torch.Tensor, xf: torch.Tensor, op: Callable[..., torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """``op(xf, scale)`` (float32 ``xf = x.float()``): in place where ``xf`` is a copy of ``x`` (not ``x``)."""
    if x.dtype != torch.float32 and torch.broadcast_shapes(xf.shape, scale.shape) == xf.shape:
        return op(xf, scale, out=xf)
    return op(xf, scale)


def fake_minifloat(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """Round trip of ``x / scale`` through ``fmt`` (``MINIFLOATS``), saturating at ``+-fmax``:
    ``round(clamp(x / scale, -fmax, fmax)) * scale`` in float32 (``x`` any shape and float dtype, ``scale``
    float32 broadcasting against it); returns (float32 values of ``x``'s shape, number of values with
    ``|x| > fmax * scale``). For "fp4-e2m1", where ``x`` holds NaN or inf or the scale is not finite and
    positive, torchao's own ``f32_to_f4_unpacked`` / ``f4_unpacked_to_f32`` when it is installed (it turns NaN
    into finite codes; without torchao NaN stays NaN)."""
    fmax = MINIFLOATS[fmt].fmax
    xf = x.float()
    a = xf.abs()
    overflow, finite = saturated_(a, fmax * scale)
    if not finite and fmt == "fp4-e2m1":
        try:
            from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked  # prototype
        except ImportError:
            pass
        else:
            return f4_unpacked_to_f32(f32_to_f4_unpacked((xf / scale).clamp(-fmax, fmax))) * scale, overflow
    y = _scaled(x, xf, torch.div, scale)
    if overflow:  # else every |x / scale| <= fmax (1 + 2^-23): it rounds to fmax at most, no clamp needed
        y.clamp_(-fmax, fmax)
    return round_(y, fmt, a).mul_(scale), overflow


def fake_mx(x: torch.Tensor, fmt: str, block: int = 32) -> torch.Tensor:
    """OCP MX round trip of ``x`` (any float dtype, last dim a multiple of ``block``): E8M0 scales per block of
    the last dim, ``fmt`` ("fp8-e4m3": MXFP8, "fp4-e2m1": MXFP4) elements; torchao's ``MXTensor.to_mx`` (FLOOR
    scales) then ``dequantize(torch.float32)``, bit for bit. Returns float32 of ``x``'s shape."""
    if x.shape[-1] % block:
        raise InputError(f"MX blocks of {block} along the last dim do not divide shape {tuple(x.shape)}")
    xf = x.float()
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    a = blocks.abs()
    amax = a.amax(dim=-1, keepdim=True)  # (..., blocks, 1); NaN for a block holding NaN
    e = torch.bitwise_right_shift(amax.view(torch.int32), F32_MANT).bitwise_and_(0xFF)
    e = e.sub_(F32_BIAS + MX_MAX_POW2[fmt]).clamp_(-F32_BIAS, F32_BIAS)  # the block scale's exponent
    div = ((e + F32_BIAS).clamp_(min=1) << F32_MANT).view(torch.float32)  # 2 ** e, at least 2 ** -126
    mul = torch.where(amax.isnan(), torch.nan, torch.where(e == -F32_BIAS, 2.0**-F32_BIAS, div))  # 2 ** e
    fmax = MINIFLOATS[fmt].fmax
    y = _scaled(x, blocks, torch.div, div).clamp_(-fmax, fmax)
    return round_(y, fmt, a).mul_(mul).reshape(x.shape)


def _nvfp4_torchao(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's own NVFP4 round trip (:func:`nvfp4`'s fallback for non-finite scales)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # prototype

    xf = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    t = NVFP4Tensor.to_nvfp4(xf, NVFP4_BLOCK, per_tensor_scale=per_tensor_amax_to_scale(xf.abs().amax().float()))
    return t.dequantize(torch.float32), t.scale.float(), t.per_tensor_scale.float()


def nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 round trip of 2-D or 3-D ``x`` (any float dtype, last dim a multiple of 16): torchao's
    ``NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale=per_tensor_amax_to_scale(max |x|))`` then
    ``dequantize(torch.float32)``, bit for bit. Returns (values, float32 of ``x``'s shape; the FP8 E4M3 block
    scales as float32, (..., rows, last dim / 16); the per-tensor scale, float32 0-d)."""
    if x.dim() not in (2, 3) or x.shape[-1] % NVFP4_BLOCK:
        raise InputError(
            f"NVFP4 takes a 2-D or 3-D tensor (torchao's layout) whose last dim is a multiple of {NVFP4_BLOCK}, "
            f"not shape {tuple(x.shape)}; keep this tensor in full precision (keep=...)"
        )
    xf = x.float()
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    a = blocks.abs()
    amax = a.amax(dim=-1, keepdim=True)  # (..., blocks, 1); NaN for a block holding NaN
    tensor_scale = amax.amax() / (MINIFLOATS["fp8-e4m3"].fmax * MINIFLOATS["fp4-e2m1"].fmax)
    block_scale = round_((amax / MINIFLOATS["fp4-e2m1"].fmax / tensor_scale).clamp_(E4M3_TINY, 448.0), "fp8-e4m3")
    recip = (1.0 / tensor_scale) / block_scale
    if not bool(recip.isfinite().all() & tensor_scale.isfinite()):  # all zeros, inf, NaN, or max |x| < ~1e-33
        try:
            return _nvfp4_torchao(x)
        except ImportError:  # without torchao, NaN elements stay NaN
            pass
    # |x * recip| <= 6 / (1 - 2^-4) (1 + 2^-21) < 7: the E4M3 block scale is at most half an ulp (2^-4) below
    # max|x_block| / 6 / t, so torchao's clamp to +-6 changes no rounded value here and is left out
    y = _scaled(x, blocks, torch.mul, recip)
    y = round_(y, "fp4-e2m1", a).mul_(tensor_scale * block_scale).reshape(x.shape)
    return y, block_scale.squeeze(-1), tensor_scale
