"""Quantizers by definition: integer and FP8 fake quantization, weight quantization at a granularity,
and range estimators that stream calibration data in bounded memory.

Integer grids (any width b in 2..8): symmetric uses q in [-(2^(b-1) - 1), 2^(b-1) - 1] with zero point 0
(int8: -127..127, 2^b - 1 levels); asymmetric uses q in [0, 2^b - 1] (2^b levels) with an integer zero
point, and its range is widened to include 0 so that 0 is represented exactly.
``fake_int(x) = (clamp(round(x * (1 / s)) + z) - z) * s``. FP8 scales x by ``amax / fmax`` (e4m3: 448,
e5m2: 57344), clamps to +-fmax (counting the values that hit the limit: the cast saturates silently)
and rounds through the float8 dtype. FP4 (E2M1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6) scales by ``amax / 6`` the
same way. Block-scaled formats (OCP MX, NVIDIA NVFP4) carry one scale per block of the last dim, computed
from the block itself, so they need no calibration: MXFP8 (E4M3 elements) and MXFP4 (E2M1), blocks of 32
with power-of-two (E8M0) scales; NVFP4, blocks of 16 with FP8 E4M3 scales under one float32 scale per
tensor. Their round trips are torchao's (``torchao.prototype.mx_formats``: ``MXTensor.to_mx``,
``NVFP4Tensor.to_nvfp4``, emulated, so they run on a CPU).

Library numerics: scales and zero points come from torchao's ``choose_qparams_affine_with_min_max``,
FP8 round trips from its ``_quantize_affine_float8`` / ``_dequantize_affine_float8`` (what its float8
tensors run); integer round trips give the numbers of PyTorch's fused ``fake_quantize_per_tensor_affine`` /
``fake_quantize_per_channel_affine`` and of torchao's ``quantize_affine`` then ``dequantize_affine``
(tests/test_bits.py checks both), written out as five vectorised float32 ops (:func:`fake_int`: PyTorch's
fused CPU kernel is 5x slower, torchao's ``_fake_quantize_affine`` takes seven passes). Where torchao is not
installed (the simulated schemes run without it) the two formulas it would supply are written out below.
"""

from __future__ import annotations

import math

import torch

try:
    from torchao.quantization import quant_primitives as ao
except ImportError:  # the simulated schemes run without torchao: the formulas it would supply, below
    ao = None

__all__ = [
    "FP8",
    "FP4",
    "BLOCK",
    "INT_BITS",
    "FORMATS",
    "int_grid",
    "int_qparams",
    "fake_int",
    "fake_fp8",
    "fake_fp4",
    "fake_block",
    "quantize_weight",
    "quantize_weight_qparams",
    "qparams",
    "percentile_range",
    "RangeObserver",
    "ESTIMATORS",
]

FP8 = {"fp8-e4m3": (torch.float8_e4m3fn, 448.0), "fp8-e5m2": (torch.float8_e5m2, 57344.0)}
FP4 = {"fp4-e2m1": 6.0}  # the largest magnitude
BLOCK = {"mxfp8": (torch.float8_e4m3fn, 32), "mxfp4": (torch.float4_e2m1fn_x2, 32), "nvfp4": (None, 16)}
INT_BITS = {f"int{b}": b for b in range(2, 9)}  # int2 .. int8
FORMATS = (*INT_BITS, *FP8, *FP4, *BLOCK)
MANTISSA = {"fp8-e4m3": 3, "fp8-e5m2": 2, "fp4-e2m1": 1}  # mantissa bits of the per-tensor float formats
EPS = 1e-12


def int_grid(bits: int, symmetric: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def int_qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (float32) that map [lo, hi] onto the b-bit grid (0 always exactly representable)."""
    qmin, qmax = int_grid(bits, symmetric)
    lo, hi = lo.float(), hi.float()
    if ao is not None:
        mapping = ao.MappingType.SYMMETRIC if symmetric else ao.MappingType.ASYMMETRIC
        return ao.choose_qparams_affine_with_min_max(
            lo,
            hi,
            mapping,
            [],
            torch.int8 if symmetric else torch.uint8,
            qmin,
            qmax,
            eps=EPS,
            zero_point_dtype=torch.float32,
        )
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if symmetric:
        scale = torch.maximum(-lo, hi) / ((qmax - qmin) / 2)
        return scale.clamp_min(EPS), torch.zeros_like(scale)
    scale = ((hi - lo) / (qmax - qmin)).clamp_min(EPS)
    zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
    return scale, zero


def fake_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Round trip of ``x`` through the b-bit grid, ``(clamp(round(x * (1 / s)) + z, qmin, qmax) - z) * s`` in
    float32 (rounding half to even), back in ``x``'s dtype. ``scale`` and ``zero`` hold one value, one per channel
    of the last dim (shape (C,) or (..., C)), or one per row of it (shape x.shape[:-1] + (1,)).

    Hand code for speed: the same numbers as PyTorch's fused ``fake_quantize_per_tensor_affine`` /
    ``fake_quantize_per_channel_affine`` (tests/test_bits.py holds it to both), which take about 5x longer
    on this CPU (7 ms against 1.4 ms for 1.5M values)."""
    qmin, qmax = int_grid(bits, symmetric)
    scale, zero = scale.float(), torch.round(zero.float())
    if scale.numel() == 1:
        scale, zero = scale.reshape(()), zero.reshape(())
    q = (x.float() * scale.reciprocal()).round_().add_(zero).clamp_(qmin, qmax).sub_(zero).mul_(scale)
    return q.to(x.dtype)


def fake_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """FP8 round trip of ``x / scale``; returns (values, number of values that saturated)."""
    dtype, fmax = FP8[fmt]
    overflow = int((x.abs() > fmax * scale).sum())
    scale = scale.reshape((1,) * (x.dim() - scale.dim()) + tuple(scale.shape))  # torchao wants x's rank
    if ao is not None:
        return ao._dequantize_affine_float8(ao._quantize_affine_float8(x, scale, dtype), scale, x.dtype), overflow
    y = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return (y.float() * scale).to(x.dtype), overflow


def fake_fp4(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """FP4 (E2M1) round trip of ``x / scale`` (round to nearest, ties to even); returns (values, saturated)."""
    from torchao.prototype.mx_formats.kernels import (  # torchao prototype: imported at first use
        f4_unpacked_to_f32,
        f32_to_f4_unpacked,
    )

    fmax = FP4["fp4-e2m1"]
    overflow = int((x.abs() > fmax * scale).sum())
    y = f4_unpacked_to_f32(f32_to_f4_unpacked((x.float() / scale).clamp(-fmax, fmax)))
    return (y * scale).to(x.dtype), overflow


def fake_block(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round trip of ``x`` through a block-scaled format (``BLOCK``), blocks along the last dim."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor  # torchao prototype: imported at first use

    elem, block = BLOCK[fmt]
    if x.shape[-1] % block:
        raise ValueError(
            f"{fmt} scales blocks of {block} values along the last dim, which holds {x.shape[-1]} here "
            f"(shape {tuple(x.shape)}); keep this tensor in full precision (keep=...) or pick a format "
            f"whose block divides it"
        )
    xf = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    rows = xf.reshape(-1, x.shape[-1])  # blocks lie along the last dim: torchao's NVFP4 takes 2-D or 3-D tensors
    t = _nvfp4(rows) if fmt == "nvfp4" else MXTensor.to_mx(rows, elem, block)
    return t.dequantize(torch.float32).reshape(x.shape).to(x.dtype)


def _nvfp4(x: torch.Tensor):
    """torchao's NVFP4 tensor of ``x``: blocks of 16 along the last dim, the per-tensor scale from max |x|."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # torchao prototype

    xf = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    return NVFP4Tensor.to_nvfp4(xf, 16, per_tensor_scale=per_tensor_amax_to_scale(xf.abs().amax().float()))


def fake_quant(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, fmt: str, symmetric: bool
) -> tuple[torch.Tensor, int]:
    """Fake-quantize ``x`` with range [lo, hi] (broadcastable) in ``fmt``; returns (values, overflow count).
    Block-scaled formats ignore the range: each block's scale comes from the block. A bfloat16 or float16 ``x``
    gets float32 arithmetic's values rounded to its dtype: PyTorch's integer fake-quantize kernels compute in
    float32; the float formats' saturation test is made on float32 values here."""
    if fmt in BLOCK:
        return fake_block(x, fmt), 0
    scale, zero = qparams(lo, hi, fmt, symmetric)
    if fmt in FP8 or fmt in FP4:
        y, overflow = fake_fp8(x.float(), scale, fmt) if fmt in FP8 else fake_fp4(x.float(), scale)
        return y.to(x.dtype), overflow
    return fake_int(x, scale, zero, INT_BITS[fmt], symmetric), 0


def qparams(lo: torch.Tensor, hi: torch.Tensor, fmt: str, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (float32, shaped like ``lo``) of range [lo, hi] in the integer, FP8 or FP4 format
    ``fmt`` (the float formats' zero point is 0): ``x = (q - zero) * scale``."""
    if fmt in FP8 or fmt in FP4:
        # torchao's float8 scale (_choose_scale_float8) reads a tensor, not a calibrated range: its formula
        fmax = FP8[fmt][1] if fmt in FP8 else FP4[fmt]
        scale = (torch.maximum(lo.abs(), hi.abs()).float() / fmax).clamp_min(EPS)
        return scale, torch.zeros_like(scale)
    return int_qparams(lo, hi, INT_BITS[fmt], symmetric)


def _grouped(w: torch.Tensor, granularity: str, group_size: int) -> torch.Tensor:
    """View the weight (out, in) so that the last dim is one quantization group."""
    if granularity == "tensor":
        return w.reshape(1, -1)
    if granularity == "channel":
        return w.reshape(w.shape[0], -1)
    group_size = min(group_size, w.shape[-1])
    if w.shape[-1] % group_size:
        raise ValueError(
            f"group size {group_size} does not divide the input width {w.shape[-1]}; pick a divisor with group_size="
        )
    return w.reshape(-1, group_size)


@torch.no_grad()
def quantize_weight(
    w: torch.Tensor,
    fmt: str,
    granularity: str = "tensor",
    symmetric: bool = True,
    group_size: int = 128,
    estimator: str = "minmax",
) -> torch.Tensor:
    """Fake-quantized copy of weight ``w`` (out, in). ``estimator="minmax"``: each group's (channel's,
    tensor's) range is its [min, max]; ``"mse"``: a grid search over clipping ratios, the range (r min, r max)
    for the 20 ratios r of ``torch.linspace(0.5, 1, 20)`` (on a symmetric grid: r max|w|) whose round trip
    has the least sum of squared errors over the group (the smallest r on a tie). Block-scaled formats
    take their own blocks along the input dim, whatever ``granularity`` says."""
    return quantize_weight_qparams(w, fmt, granularity, symmetric, group_size, estimator)[0]


@torch.no_grad()
def quantize_weight_qparams(
    w: torch.Tensor,
    fmt: str,
    granularity: str = "tensor",
    symmetric: bool = True,
    group_size: int = 128,
    estimator: str = "minmax",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`quantize_weight`, with the scale and zero point it used (float32, one per row (channel),
    per (row, group) of ``group_size`` inputs, or a single one: shape (1,), (out, 1) or (out, in / group);
    ``q = (w / scale).round() + zero``); for NVFP4, its FP8 block scales (as float32, (out, in / 16)) and the
    per-tensor scale in place of the zero point; None for the MX formats, whose scales are powers of two."""
    if fmt == "nvfp4":
        t = _nvfp4(w)
        return t.dequantize(torch.float32).to(w.dtype), t.scale.float(), t.per_tensor_scale.float().reshape(1)
    if fmt in BLOCK:
        return fake_block(w, fmt), None, None
    g = _grouped(w.float(), granularity, group_size)
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    if estimator == "mse":
        best_err = torch.full_like(lo, float("inf"))
        best = (lo, hi)
        for r in torch.linspace(0.5, 1.0, 20):
            q, _ = fake_quant(g, lo * r, hi * r, fmt, symmetric)
            err = (q - g).square().sum(dim=1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, lo * r, best[0]), torch.where(better, hi * r, best[1]))
        lo, hi = best
    elif estimator != "minmax":
        raise ValueError(f"unknown weight range estimator {estimator!r}; valid: minmax, mse")
    q, _ = fake_quant(g, lo, hi, fmt, symmetric)
    scale, zero = qparams(lo, hi, fmt, symmetric)
    shape = (1,) if granularity == "tensor" else (w.shape[0], -1)
    return q.reshape(w.shape).to(w.dtype), scale.reshape(shape), zero.reshape(shape)


LOG_LO, LOG_HI, BINS = -12.0, 8.0, 4000  # |x| histograms: 0.005 decade per bin
ESTIMATORS = ("minmax", "running-minmax", "percentile", "mse", "running-percentile")  # static activation ranges


@torch.no_grad()
def percentile_range(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The (100 - p)-th and p-th percentiles of all the values of ``x``, exactly: the q-quantile of n sorted
    values v is ``v[f] + (h - f) (v[f + 1] - v[f])``, h = q (n - 1), f = floor(h) (linear interpolation
    between order statistics, numpy.percentile's and torch.quantile's default, which the reference's
    ``np.percentile`` takes). Read off the two tails with topk, so any size works (torch.quantile takes at
    most 2^24 values) and p = 99.999 sorts a few values, not all of them."""
    flat = x.detach().reshape(-1).float()
    return -_upper_quantile(-flat, p / 100), _upper_quantile(flat, p / 100)


def _upper_quantile(v: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile (q >= 0.5) of the values of 1-d ``v`` (:func:`percentile_range`)."""
    n = v.numel()
    h = q * (n - 1)
    f = min(math.floor(h), n - 1)
    top = torch.topk(v, n - f).values  # descending: top[i] is the (n - 1 - i)-th smallest value
    below, above = top[n - 1 - f], top[max(n - 2 - f, 0)]
    return below + (h - f) * (above - below)


class RangeObserver:
    """Streams calibration tensors into the statistics every range estimator needs, in O(1) memory.

    * ``minmax``: the global min and max;
    * ``running-minmax``: exponential moving average of per-batch min/max (momentum m: r = m r + (1-m) x,
      the first batch's value to start);
    * ``running-percentile``: the same average of each batch's exact (100-p)-th and p-th percentiles
      (:func:`percentile_range`) in place of its min and max: the reference's ``RunningMinMaxEstimator``
      with ``percentile`` (Bondarenko et al.'s OPT command, ``--percentile 99.999``);
    * ``percentile``: the p-th and (100-p)-th percentiles, read off signed log-magnitude histograms
      (0.005-decade bins, so within ~1.2 % of the exact value);
    * ``mse``: the clipping range whose expected squared error (clipping + uniform rounding noise
      scale^2 / 12 inside the range) over those histograms is smallest.
    ``per_channel`` keeps per-channel min/max (minmax and running-minmax only). A tensor holding NaN or
    inf is refused (ValueError naming ``name``): no range could cover it.
    """

    def __init__(
        self,
        estimator: str = "minmax",
        momentum: float = 0.9,
        percentile: float = 99.999,
        per_channel: bool = False,
        name: str = "activations",
    ):
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown range estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
        if per_channel and estimator not in ("minmax", "running-minmax"):
            raise ValueError("per-channel activation ranges support the minmax and running-minmax estimators")
        self.estimator, self.momentum, self.percentile, self.per_channel = estimator, momentum, percentile, per_channel
        self.name = name
        self.lo: torch.Tensor | None = None  # all four are set by the first update
        self.hi: torch.Tensor | None = None
        self.run_lo: torch.Tensor | None = None
        self.run_hi: torch.Tensor | None = None
        self.pos = torch.zeros(BINS, dtype=torch.float64)
        self.neg = torch.zeros(BINS, dtype=torch.float64)
        self.batches = 0

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        dims = tuple(range(x.dim() - 1)) if self.per_channel else tuple(range(x.dim()))
        lo, hi = x.amin(dim=dims), x.amax(dim=dims)  # NaN and inf propagate into these
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise ValueError(
                f"{self.name}: the calibration activations hold NaN or inf, which no quantization range "
                f"covers (the float model overflows or holds NaN on these batches); check the model and "
                f"its dtype in float (e.g. quantgate observe) or calibrate on other batches"
            )
        run_lo, run_hi = percentile_range(x, self.percentile) if self.estimator == "running-percentile" else (lo, hi)
        if self.lo is None:
            self.lo, self.hi, self.run_lo, self.run_hi = lo, hi, run_lo, run_hi
        else:
            assert self.hi is not None and self.run_lo is not None and self.run_hi is not None
            m = self.momentum
            self.lo, self.hi = torch.minimum(self.lo, lo), torch.maximum(self.hi, hi)
            self.run_lo, self.run_hi = m * self.run_lo + (1 - m) * run_lo, m * self.run_hi + (1 - m) * run_hi
        if self.estimator in ("percentile", "mse"):
            flat = x.reshape(-1)
            for values, hist in ((flat[flat > 0], self.pos), (-flat[flat < 0], self.neg)):
                logs = torch.log10(values.clamp_min(10**LOG_LO)).clamp_max(LOG_HI - 1e-9)
                hist += torch.histc(logs, bins=BINS, min=LOG_LO, max=LOG_HI).double()
        self.batches += 1

    def range(self, fmt: str, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibrated (lo, hi)."""
        if self.lo is None:
            raise ValueError("no calibration data reached this quantizer; give calibration batches")
        assert self.hi is not None and self.run_lo is not None and self.run_hi is not None
        if self.estimator == "minmax":
            return self.lo, self.hi
        if self.estimator in ("running-minmax", "running-percentile"):
            return self.run_lo, self.run_hi
        values, counts = self._signed_bins()
        if not float(counts.sum()):  # every value seen was 0: the histograms are empty, min-max is [0, 0]
            return self.lo, self.hi
        if self.estimator == "percentile":
            cdf = counts.cumsum(0) / counts.sum()
            p = self.percentile / 100
            lo = values[int(torch.searchsorted(cdf, torch.tensor(1 - p, dtype=torch.float64)))]
            hi = values[min(int(torch.searchsorted(cdf, torch.tensor(p, dtype=torch.float64))), len(values) - 1)]
            return torch.tensor(min(float(lo), 0.0)), torch.tensor(max(float(hi), 0.0))
        return self._mse_range(self.lo, self.hi, values, counts, fmt, symmetric)

    def _signed_bins(self) -> tuple[torch.Tensor, torch.Tensor]:
        centres = 10 ** (LOG_LO + (torch.arange(BINS, dtype=torch.float64) + 0.5) * (LOG_HI - LOG_LO) / BINS)
        values = torch.cat([-centres.flip(0), centres])
        counts = torch.cat([self.neg.flip(0), self.pos])
        return values, counts

    def _mse_range(self, lo_seen: torch.Tensor, hi_seen: torch.Tensor, values, counts, fmt, symmetric):
        lo0, hi0 = float(lo_seen.min()), float(hi_seen.max())
        best, best_err = (lo0, hi0), math.inf
        for r in torch.logspace(-3, 0, 120, dtype=torch.float64):
            lo, hi = lo0 * float(r), hi0 * float(r)
            if fmt in MANTISSA:  # relative rounding error ~ 2^-mantissa per value, plus clipping
                amax = max(abs(lo), abs(hi))
                mant = MANTISSA[fmt]
                inside = values.abs() <= amax
                rounding = (values * 2.0 ** -(mant + 1)).square() / 3
                clip = (values.abs() - amax).clamp_min(0).square()
                err = float((counts * torch.where(inside, rounding, clip)).sum())
            else:
                qmin, qmax = int_grid(INT_BITS[fmt], symmetric)
                span = 2 * max(abs(lo), abs(hi)) if symmetric else max(hi, 0.0) - min(lo, 0.0)
                scale = span / (qmax - qmin)
                lo_c, hi_c = (-span / 2, span / 2) if symmetric else (min(lo, 0.0), max(hi, 0.0))
                clip = (values - hi_c).clamp_min(0).square() + (lo_c - values).clamp_min(0).square()
                err = float((counts * (clip + scale**2 / 12 * ((values >= lo_c) & (values <= hi_c)))).sum())
            if err < best_err:
                best, best_err = (lo, hi), err
        return torch.tensor(best[0]), torch.tensor(best[1])
