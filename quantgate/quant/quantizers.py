"""Quantizers by definition: integer and FP8 fake quantization, weight quantization at a granularity, and range
estimators that stream calibration data in bounded memory.

Integer grids (any width b in 2..8): symmetric uses q in [-(2^(b-1) - 1), 2^(b-1) - 1] with zero point 0 (int8:
-127..127, 2^b - 1 levels); asymmetric uses q in [0, 2^b - 1] (2^b levels) with an integer zero point, and its range
is widened to include 0 so that 0 is represented exactly. ``fake_int(x) = (clamp(round(x * (1 / s)) + z) - z) * s``.
FP8 scales x by ``amax / fmax`` (e4m3: 448, e5m2: 57344), clamps to +-fmax (counting the values that hit the limit:
the cast saturates silently) and rounds to the nearest float8 value (ties to even). FP4 (E2M1, values 0, 0.5, 1,
1.5, 2, 3, 4, 6) scales by ``amax / 6`` the same way. Block-scaled formats (OCP MX, NVIDIA NVFP4) carry one scale
per block of the last dim, computed from the block itself, so they need no calibration: MXFP8 (E4M3 elements) and
MXFP4 (E2M1), blocks of 32 with power-of-two (E8M0) scales; NVFP4, blocks of 16 with FP8 E4M3 scales under one
float32 scale per tensor. Their round trips give torchao's numbers (``torchao.prototype.mx_formats``:
``MXTensor.to_mx``, ``NVFP4Tensor.to_nvfp4``, emulated, so they run on a CPU).

Library numerics: scales and zero points come from torchao's ``choose_qparams_affine_with_min_max``; the FP8, FP4,
MX and NVFP4 round trips give, bit for bit, the numbers of torchao's ``_quantize_affine_float8`` /
``_dequantize_affine_float8`` (what its float8 tensors run), FP4 code and ``mx_formats`` tensors, written out in
float32 / int32 ops by :mod:`.minifloat` without float8 or FP4 casts (1.2-10x faster on a CPU;
tests/test_fast_quant.py holds them to torchao); integer round trips give the numbers of PyTorch's fused
``fake_quantize_per_tensor_affine`` / ``fake_quantize_per_channel_affine`` and of torchao's ``quantize_affine`` then
``dequantize_affine`` (tests/test_bits.py checks both), written out as five vectorised float32 ops
(:func:`fake_int`: PyTorch's fused CPU kernel is 5x slower, torchao's ``_fake_quantize_affine`` takes seven passes).
Where torchao is not installed (the simulated schemes run without it) the qparams formula it would supply is written
out below.
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError
from . import fused
from .minifloat import fake_minifloat, fake_mx, nvfp4

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
    "WEIGHT_QPARAMS",
]

FP8 = {"fp8-e4m3": (torch.float8_e4m3fn, 448.0), "fp8-e5m2": (torch.float8_e5m2, 57344.0)}
FP4 = {"fp4-e2m1": 6.0}  # the largest magnitude
BLOCK = {"mxfp8": (torch.float8_e4m3fn, 32), "mxfp4": (torch.float4_e2m1fn_x2, 32), "nvfp4": (None, 16)}
MX_ELEMENT = {"mxfp8": "fp8-e4m3", "mxfp4": "fp4-e2m1"}  # the element formats of .minifloat.MINIFLOATS
INT_BITS = {f"int{b}": b for b in range(2, 9)}  # int2 .. int8
FORMATS = (*INT_BITS, *FP8, *FP4, *BLOCK)
# the attribute of a quantized Linear holding its weight's (scale, zero point), float32, as
# quantizers.quantize_weight_qparams returns them (not in the state dict: the export formats store them)
WEIGHT_QPARAMS = "qg_weight_qparams"
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
    """:func:`fake_int_reference`'s values, in one pass where the fused kernels serve (:mod:`.fused`)."""
    qmin, qmax = int_grid(bits, symmetric)
    y = fused.fake_int(x, scale, zero, qmin, qmax)
    return fake_int_reference(x, scale, zero, bits, symmetric) if y is None else y


def fake_int_reference(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool
) -> torch.Tensor:
    """Round trip of ``x`` through the b-bit grid, ``(clamp(round(x * (1 / s)) + z, qmin, qmax) - z) * s`` in
    float32 (rounding half to even), back in ``x``'s dtype. ``scale`` and ``zero`` hold one value, one per channel
    of the last dim (shape (C,) or (..., C)), or one per row of it (shape x.shape[:-1] + (1,)).

    Hand code for speed: the same numbers as PyTorch's fused ``fake_quantize_per_tensor_affine`` /
    ``fake_quantize_per_channel_affine`` (tests/test_bits.py holds it to both), which take about 5x longer
    on this CPU (7 ms against 1.4 ms for 1.5M values)."""
    qmin, qmax = int_grid(bits, symmetric)
    scale, zero = scale.float(), torch.round(zero.float())
    if scale.numel() == 1:
        scale = scale.reshape(())
    xf = x.float()
    q = x * scale.reciprocal() if xf is x else xf.mul_(scale.reciprocal())  # x itself is never written
    # round(x / s) + z in [qmin, qmax] <=> round(x / s) in [qmin - z, qmax - z]: integers, exact in float32, so
    # two passes fewer than adding z and taking it off again (the same values; a -0.0 may come out as +0.0)
    if zero.numel() == 1:
        z = float(zero)
        q = q.round_().clamp_(qmin - z, qmax - z)
    else:
        q = torch.clamp(q.round_(), qmin - zero, qmax - zero, out=q)
    return q.mul_(scale).to(x.dtype)


def fake_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """FP8 round trip of ``x / scale`` (``x`` any shape and float dtype, float32 ``scale`` one value, one per
    channel of the last dim or one per row); returns (values in ``x``'s dtype, number of values with
    ``|x| > fmax * scale``, which saturate). The numbers of torchao's ``_quantize_affine_float8`` then
    ``_dequantize_affine_float8`` (x / scale in float32, clamped to +-fmax, cast to the float8 dtype, times the
    scale), computed by :func:`.minifloat.fake_minifloat` without the float8 casts: 1.2x (e5m2) to 2.3x (e4m3)
    faster per call on this CPU, where casting back from float8_e4m3fn is slow."""
    scale = scale.reshape((1,) * (x.dim() - scale.dim()) + tuple(scale.shape))  # x's rank, as torchao has it
    fast = fused.fake_minifloat(x, scale, fmt)
    if fast is not None:
        return fast
    y, overflow = fake_minifloat(x, scale.float(), fmt)
    return y.to(x.dtype), overflow


def fake_fp4(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """FP4 (E2M1) round trip of ``x / scale`` (round to nearest, ties to even; shapes as :func:`fake_fp8`);
    returns (values in ``x``'s dtype, saturated). The numbers of torchao's ``f32_to_f4_unpacked`` then
    ``f4_unpacked_to_f32`` on ``clamp(x / scale, -6, 6)``, times the scale, computed by
    :func:`.minifloat.fake_minifloat` (torchao's own path where ``x`` holds NaN or inf)."""
    fast = fused.fake_minifloat(x, scale, "fp4-e2m1")
    if fast is not None:
        return fast
    y, overflow = fake_minifloat(x, scale.float(), "fp4-e2m1")
    return y.to(x.dtype), overflow


def fake_block(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round trip of ``x`` (any shape, float dtype) through a block-scaled format (``BLOCK``), blocks along the
    last dim; values in ``x``'s dtype. torchao's numbers (``MXTensor.to_mx``, FLOOR scales, or
    ``NVFP4Tensor.to_nvfp4`` with the per-tensor scale of max |x|, then ``dequantize``), computed by
    :func:`.minifloat.fake_mx` / :func:`.minifloat.nvfp4` over all blocks at once."""
    _, block = BLOCK[fmt]
    if x.shape[-1] % block:
        raise InputError(
            f"{fmt} scales blocks of {block} values along the last dim, which holds {x.shape[-1]} here "
            f"(shape {tuple(x.shape)}); keep this tensor in full precision (keep=...) or pick a format "
            f"whose block divides it"
        )
    if fmt == "nvfp4":  # torchao's NVFP4 takes 2-D tensors: the per-tensor scale spans all of x
        fast = fused.fake_nvfp4(x)
        return nvfp4(x.reshape(-1, x.shape[-1]))[0].reshape(x.shape).to(x.dtype) if fast is None else fast
    fast = fused.fake_mx(x, MX_ELEMENT[fmt], block)
    return fake_mx(x, MX_ELEMENT[fmt], block).to(x.dtype) if fast is None else fast


def fake_quant(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    fmt: str,
    symmetric: bool,
    grid: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """Fake-quantize ``x`` with range [lo, hi] (broadcastable) in ``fmt``; returns (values, overflow count).
    Block-scaled formats ignore the range: each block's scale comes from the block. A bfloat16 or float16 ``x``
    gets float32 arithmetic's values rounded to its dtype: PyTorch's integer fake-quantize kernels compute in
    float32; the float formats' saturation test is made on float32 values here. ``grid``: ``qparams(lo, hi,
    fmt, symmetric)`` computed before (a frozen static range's, kept by its quantizer)."""
    if fmt in BLOCK:
        return fake_block(x, fmt), 0
    scale, zero = qparams(lo, hi, fmt, symmetric) if grid is None else grid
    if fmt in FP8 or fmt in FP4:
        y, overflow = fake_fp8(x, scale, fmt) if fmt in FP8 else fake_fp4(x, scale)  # float32 inside
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
        raise InputError(
            f"group size {group_size} does not divide the input width {w.shape[-1]}; pick a divisor with group_size="
        )
    return w.reshape(-1, group_size)


# values of a weight quantized at a time (1 MiB of float32): the float32 temporaries of the arithmetic are a few
# of these, whatever the tensor's size (an embedding table of 155M values in bf16 took 10 bytes per value at once)
CHUNK = 1 << 18
# a chunked per-tensor MSE search sums each ratio's squared error over the chunks (in float64); it takes the ratio
# whose error is below every other's by more than this fraction (float32's whole-tensor sum, which the unchunked
# search compares, is within ~1e-6 of it), else it repeats the search with that float32 sum (a tensor-sized buffer)
MSE_MARGIN = 1e-4


@torch.no_grad()
def quantize_weight(
    w: torch.Tensor,
    fmt: str,
    granularity: str = "tensor",
    symmetric: bool = True,
    group_size: int = 128,
    estimator: str = "minmax",
    *,
    inplace: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """Fake-quantized copy of weight ``w`` (out, in). ``estimator="minmax"``: each group's (channel's,
    tensor's) range is its [min, max]; ``"mse"``: a grid search over clipping ratios, the range (r min, r max)
    for the 20 ratios r of ``torch.linspace(0.5, 1, 20)`` (on a symmetric grid: r max|w|) whose round trip
    has the least sum of squared errors over the group (the smallest r on a tie). Block-scaled formats
    take their own blocks along the input dim, whatever ``granularity`` says. ``inplace`` and ``chunk``:
    :func:`quantize_weight_qparams`."""
    q, _, _ = quantize_weight_qparams(
        w, fmt, granularity, symmetric, group_size, estimator, inplace=inplace, chunk=chunk
    )
    return q


@torch.no_grad()
def quantize_weight_qparams(
    w: torch.Tensor,
    fmt: str,
    granularity: str = "tensor",
    symmetric: bool = True,
    group_size: int = 128,
    estimator: str = "minmax",
    *,
    inplace: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`quantize_weight`, with the scale and zero point it used (float32, one per row (channel),
    per (row, group) of ``group_size`` inputs, or a single one: shape (1,), (out, 1) or (out, in / group);
    ``q = (w / scale).round() + zero``); for NVFP4, its FP8 block scales (as float32, (out, in / 16)) and the
    per-tensor scale in place of the zero point; None for the MX formats, whose scales are powers of two.

    The integer and per-tensor float formats run over blocks of whole groups of about ``chunk`` values (default
    :data:`CHUNK`; a tensor's or a single group's range first, in a pass of its own), so their float32
    temporaries are those of one block; ``inplace`` writes the values into ``w`` itself (a plain, contiguous
    tensor; else, and for the block-scaled formats, a new tensor is returned). The numbers are those of the
    whole tensor at once, bit for bit (tests/test_inplace_memory.py)."""
    if fmt == "nvfp4":
        values, block_scales, tensor_scale = nvfp4(w)
        return values.to(w.dtype), block_scales, tensor_scale.reshape(1)
    if fmt in BLOCK:
        return fake_block(w, fmt), None, None
    if estimator not in ("minmax", "mse"):
        raise InputError(f"unknown weight range estimator {estimator!r}; valid: minmax, mse")
    chunk = CHUNK if chunk is None else chunk
    writable = inplace and type(w) is torch.Tensor and w.is_contiguous() and not w.is_inference()
    out = w if writable else torch.empty(w.shape, dtype=w.dtype, device=w.device)
    g, o = _grouped(w, granularity, group_size), _grouped(out, granularity, group_size)  # o: a view of out
    rows, width = g.shape
    if rows == 1:  # one group (a tensor's range): blocks of its values, the range from all of them first
        chunk = max(chunk, 1)
        blocks = [(slice(None), slice(a, a + chunk)) for a in range(0, width, chunk)]
        ranges = [torch.aminmax(g[b]) for b in blocks]  # over all of the block: aminmax(dim=) is ~10x slower
        lo = torch.stack([r.min for r in ranges]).amin().float().reshape(1, 1)
        hi = torch.stack([r.max for r in ranges]).amax().float().reshape(1, 1)
        if estimator == "mse":
            lo, hi = _mse_range(g, blocks, lo, hi, fmt, symmetric)
        for b in blocks:
            o[b] = fake_quant(g[b].float(), lo, hi, fmt, symmetric)[0]
    else:  # blocks of whole groups, at least two (a single row's sum would be split over threads)
        step = max(2, chunk // width)
        bounds = [*range(0, rows, step), rows]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
            del bounds[-2]
        los, his = (torch.empty(rows, 1, dtype=torch.float32, device=w.device) for _ in "lh")  # filled in place
        for k in range(len(bounds) - 1):
            a, z = bounds[k], bounds[k + 1]
            gf = g[a:z].float()
            lo, hi = gf.amin(dim=1, keepdim=True), gf.amax(dim=1, keepdim=True)
            if estimator == "mse":
                lo, hi = _mse_range(gf, [(slice(None), slice(None))], lo, hi, fmt, symmetric)
            o[a:z] = fake_quant(gf, lo, hi, fmt, symmetric)[0]
            los[a:z], his[a:z] = lo, hi
        lo, hi = los, his
    scale, zero = qparams(lo, hi, fmt, symmetric)
    shape = (1,) if granularity == "tensor" else (w.shape[0], -1)
    return out, scale.reshape(shape), zero.reshape(shape)


_RATIOS = 20  # the MSE search's clipping ratios, torch.linspace(0.5, 1, 20)


def _mse_range(
    g: torch.Tensor,
    blocks: list[tuple[slice, slice]],
    lo: torch.Tensor,
    hi: torch.Tensor,
    fmt: str,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MSE search of :func:`quantize_weight` over the groups (rows) of ``g`` with ranges [lo, hi]: the
    clipped range (r lo, r hi) with the least sum of squared errors per group. ``blocks`` split ``g``'s one
    row into column blocks (a per-tensor range, :data:`MSE_MARGIN`), or are one block of whole rows."""
    ratios = torch.linspace(0.5, 1.0, _RATIOS)
    if len(blocks) == 1:  # the whole search at once, as the rows' sums come out of one tensor
        gf = g[blocks[0]].float()
        best_err = torch.full_like(lo, float("inf"))
        best = (lo, hi)
        for r in ratios:
            q, _ = fake_quant(gf, lo * r, hi * r, fmt, symmetric)
            err = (q - gf).square().sum(dim=1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, lo * r, best[0]), torch.where(better, hi * r, best[1]))
        return best
    errs = [0.0] * _RATIOS  # Python floats: float64 over the blocks' float32 sums
    for b in blocks:
        gf = g[b].float()
        for i, r in enumerate(ratios):
            errs[i] += float((fake_quant(gf, lo * r, hi * r, fmt, symmetric)[0] - gf).square().sum())
    low, second = sorted(errs)[:2]
    if all(math.isfinite(e) for e in errs) and second - low > MSE_MARGIN * low:
        r = ratios[errs.index(low)]
        return lo * r, hi * r
    squares = torch.empty(g.shape, dtype=torch.float32, device=g.device)  # a near tie: float32's sums, as unchunked
    best_err = torch.full_like(lo, float("inf"))
    best = (lo, hi)
    for r in ratios:
        for b in blocks:
            gf = g[b].float()
            squares[b] = (fake_quant(gf, lo * r, hi * r, fmt, symmetric)[0] - gf).square()
        err = squares.sum(dim=1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = (torch.where(better, lo * r, best[0]), torch.where(better, hi * r, best[1]))
    return best


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
            raise InputError(f"unknown range estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
        if per_channel and estimator not in ("minmax", "running-minmax"):
            raise InputError("per-channel activation ranges support the minmax and running-minmax estimators")
        self.estimator, self.momentum, self.percentile, self.per_channel = estimator, momentum, percentile, per_channel
        self.name = name
        self.lo: torch.Tensor | None = None  # all four are set by the first update
        self.hi: torch.Tensor | None = None
        self.run_lo: torch.Tensor | None = None
        self.run_hi: torch.Tensor | None = None
        # the signed log-magnitude histograms, for the estimators that read them (percentile, mse): not kept for
        # the others (64 KiB per quantizer, a few percent of a small model's bytes)
        histograms = BINS if estimator in ("percentile", "mse") else 0
        self.pos = torch.zeros(histograms, dtype=torch.float64)
        self.neg = torch.zeros(histograms, dtype=torch.float64)
        self.batches = 0

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        dims = tuple(range(x.dim() - 1)) if self.per_channel else tuple(range(x.dim()))
        lo, hi = x.amin(dim=dims), x.amax(dim=dims)  # NaN and inf propagate into these
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise InputError(
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
            raise InputError("no calibration data reached this quantizer; give calibration batches")
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
