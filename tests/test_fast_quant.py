"""The fast FP8 / FP4 / MX / NVFP4 fake quantization (quantgate.quant.minifloat) gives torchao's numbers bit for
bit: every function against torchao called here directly, on normal and log-normal values spanning many
decades, exact ties at grid midpoints, zeros of both signs, values in the grids' and float32's subnormal
ranges, saturating values, NaN and inf, float32 and bfloat16 inputs and odd shapes."""

from __future__ import annotations

import sys

import pytest
import torch

from quantgate.quant import minifloat
from quantgate.quant.quantizers import FP8, fake_block, fake_fp4, fake_fp8, fake_quant, quantize_weight_qparams

ao = pytest.importorskip("torchao.quantization.quant_primitives")
kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
DTYPES = [torch.float32, torch.bfloat16]


# torchao's round trips, as quantgate called them before the fast path
def _ref_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    dtype, fmax = FP8[fmt]
    overflow = int((x.abs() > fmax * scale).sum())
    s = scale.reshape((1,) * (x.dim() - scale.dim()) + tuple(scale.shape))
    return ao._dequantize_affine_float8(ao._quantize_affine_float8(x, s, dtype), s, x.dtype), overflow


def _ref_fp4(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    overflow = int((x.abs() > 6.0 * scale).sum())
    y = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked((x.float() / scale).clamp(-6.0, 6.0)))
    return (y * scale).to(x.dtype), overflow


def _ref_nvfp4(x: torch.Tensor):
    xf = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    scale = nvfp4_tensor.per_tensor_amax_to_scale(xf.abs().amax().float())
    return nvfp4_tensor.NVFP4Tensor.to_nvfp4(xf, 16, per_tensor_scale=scale)


def _ref_block(x: torch.Tensor, fmt: str) -> torch.Tensor:
    rows = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).reshape(-1, x.shape[-1])
    if fmt == "nvfp4":
        t = _ref_nvfp4(rows)
    else:
        elem = torch.float8_e4m3fn if fmt == "mxfp8" else torch.float4_e2m1fn_x2
        t = mx_tensor.MXTensor.to_mx(rows, elem, 32)
    return t.dequantize(torch.float32).reshape(x.shape).to(x.dtype)


def _assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype, shape, NaN positions and bits elsewhere (the sign of zero included)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if not ref.is_floating_point():
        assert torch.equal(ours, ref)
        return
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)
    as_int = torch.int32 if ref.dtype == torch.float32 else torch.int16
    assert torch.equal(ours.masked_fill(nan, 0).view(as_int), ref.masked_fill(nan, 0).view(as_int))


def _grid(fmt: str) -> torch.Tensor:
    """Every non-negative finite value of a per-element format, ascending."""
    if fmt == "fp4-e2m1":
        return E2M1
    dtype = FP8[fmt][0]
    values = torch.arange(128, dtype=torch.uint8).view(dtype).float()
    return values[values.isfinite()].sort().values


def _midpoints(fmt: str) -> torch.Tensor:
    """The exact ties between neighbouring grid values, both signs, and the float32 values one ulp either side."""
    g = _grid(fmt)
    mid = (g[1:] + g[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    return torch.cat([near, -near])


def _values(gen: torch.Generator, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Normal values; log-normal magnitudes over ~20 decades with random signs; a mixture holding zeros of both
    signs, float32 subnormals, inf-free huge values and ordinary ones."""
    n = torch.Size(shape).numel()
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    mixed = torch.randn(n, generator=gen)
    pick = torch.randint(0, 5, (n,), generator=gen)
    mixed = torch.where(pick == 0, 0.0, mixed)
    mixed = torch.where(pick == 1, -0.0, mixed)
    mixed = torch.where(pick == 2, mixed * 2.0**-135, mixed)  # float32 subnormals
    mixed = torch.where(pick == 3, mixed * 1e30, mixed)
    return [
        torch.randn(shape, generator=gen),
        sign * torch.exp(torch.randn(shape, generator=gen) * 10),
        mixed.reshape(shape),
    ]


@pytest.mark.parametrize("fmt", [*FP8, "fp4-e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_float_formats_equal_torchao(fmt, dtype):
    """fake_fp8 / fake_fp4 against torchao: values, saturation counts, per tensor, per channel and per row."""
    gen = torch.Generator().manual_seed(0)
    fmax = FP8[fmt][1] if fmt in FP8 else 6.0
    ties = _midpoints(fmt) * 2.0**-5  # a power-of-two scale keeps the ties exact after x / scale
    cases = [(x, None) for x in _values(gen, (3, 7, 37))] + [(ties.reshape(1, -1), torch.tensor(2.0**-5))]
    saturated = 0
    for x, fixed in cases:
        x = x.to(dtype)
        amax = x.float().abs().amax()
        scales = [fixed] if fixed is not None else []
        scales += [
            amax / fmax,  # nothing saturates
            amax / fmax / 100,  # many values saturate
            amax / fmax * 1e6,  # the grid's subnormal range
            torch.rand(x.shape[-1], generator=gen) * amax / fmax + 1e-12,  # per channel
            torch.rand((*x.shape[:-1], 1), generator=gen) * amax / fmax + 1e-12,  # per row
        ]
        for scale in scales:
            xs = x.float()
            ours, over = fake_fp8(xs, scale, fmt) if fmt in FP8 else fake_fp4(xs, scale)
            ref, ref_over = _ref_fp8(xs, scale, fmt) if fmt in FP8 else _ref_fp4(xs, scale)
            _assert_bits_equal(ours, ref)
            assert over == ref_over
            saturated += over
            direct, _ = fake_fp8(x, scale, fmt) if fmt in FP8 else fake_fp4(x, scale)  # x in its own dtype
            _assert_bits_equal(direct, (_ref_fp8(x, scale, fmt) if fmt in FP8 else _ref_fp4(x, scale))[0])
    assert saturated > 0


def _mx_ties(fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32 whose scale is 2^k (their first value 2^(k + max pow2)) and whose other values are exact
    grid midpoints times 2^k: exact ties after the division by the block scale."""
    elem = "fp8-e4m3" if fmt == "mxfp8" else "fp4-e2m1"
    top = 2.0 ** minifloat.MX_MAX_POW2[elem]
    mid = _midpoints(elem)
    mid = mid[mid.abs() < 2 * top]  # leaves the block's exponent to the first value
    rows = []
    for k in (-130, -120, -20, -1, 0, 3, 60):  # k = -130 / -120: the smallest E8M0 scales
        vals = mid[torch.randint(0, len(mid), (31,), generator=gen)]
        rows.append(torch.cat([torch.tensor([top]), vals]) * 2.0**k)
    return torch.stack(rows)


def _nvfp4_ties() -> torch.Tensor:
    """Rows of 16 whose scales are powers of two (tensor max 2688 * 2^a, block max 6 * 2^(a + b)), the other
    values the E2M1 grid's midpoints times 2^(a + b): exact ties after multiplying by the reciprocal scale."""
    mid = _midpoints("fp4-e2m1")
    mid = mid[mid.abs() < 6][:15]
    a = -4
    rows = [torch.cat([torch.tensor([2688.0]), torch.zeros(15)]) * 2.0**a]
    for b in (-5, 0, 3, 6):
        rows.append(torch.cat([torch.tensor([6.0]), mid]) * 2.0 ** (a + b))
    # block maxima at 6 t times the E4M3 grid's midpoints: their scales round down by up to 2^-4 (ties to even),
    # the largest value of the block is up to 6.375 before its E2M1 rounding
    scale_mid = _midpoints("fp8-e4m3")
    scale_mid = scale_mid[(scale_mid >= 2.0**-6) & (scale_mid <= 448)]
    gen = torch.Generator().manual_seed(6)
    for m in scale_mid:
        inner = (torch.rand(15, generator=gen) * 2 - 1) * m
        rows.append(torch.cat([m.reshape(1), inner]) * 6 * 2.0**a)
        rows.append(-rows[-1])
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_formats_equal_torchao(fmt, dtype):
    """fake_block against torchao's MXTensor.to_mx / NVFP4Tensor.to_nvfp4 then dequantize."""
    gen = torch.Generator().manual_seed(1)
    width = 48 if fmt == "nvfp4" else 96  # three blocks (NVFP4: of 16)
    cases = _values(gen, (3, 5, width)) + _values(gen, (7, width))
    cases.append(_nvfp4_ties() if fmt == "nvfp4" else _mx_ties(fmt, gen))
    tiny = 2.0 ** torch.tensor([[-149.0], [-140.0], [-130.0], [-121.0], [-118.0], [-110.0]])
    cases.append(torch.randn(6, width, generator=gen) * tiny)  # the smallest E8M0 scales (NVFP4: torchao's path)
    for x in cases:
        x = x.to(dtype)
        _assert_bits_equal(fake_block(x, fmt), _ref_block(x, fmt))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_weights_and_scales_equal_torchao(fmt, dtype):
    """quantize_weight_qparams for the block formats: values and NVFP4's block and per-tensor scales."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(24, 64, generator=gen) * torch.exp(torch.randn(24, 1, generator=gen) * 3)).to(dtype)
    q, scale, zero = quantize_weight_qparams(w, fmt)
    if fmt == "nvfp4":
        t = _ref_nvfp4(w)
        _assert_bits_equal(q, t.dequantize(torch.float32).to(dtype))
        assert scale is not None and zero is not None
        _assert_bits_equal(scale, t.scale.float())
        _assert_bits_equal(zero, t.per_tensor_scale.float().reshape(1))
    else:
        _assert_bits_equal(q, _ref_block(w, fmt))
        assert scale is None and zero is None


def test_rounding_matches_the_casts_on_every_exponent():
    """minifloat.round_ against torch's float8 casts and torchao's FP4 code on every bfloat16 bit pattern (all
    float32 exponents, both signs) with random low mantissa bits, and on the exact ties."""
    gen = torch.Generator().manual_seed(3)
    high = torch.arange(-(2**15), 2**15, dtype=torch.int32) << 16
    low = torch.randint(0, 2**16, high.shape, generator=gen, dtype=torch.int32)
    patterns = torch.cat([high, high | low, high | 0xFFFF]).view(torch.float32)
    for fmt, m in minifloat.MINIFLOATS.items():
        v = torch.cat([patterns, _midpoints(fmt), _midpoints(fmt) * 2.0**-20]).clamp(-m.fmax, m.fmax)
        if fmt == "fp4-e2m1":
            v = v[~v.isnan()]  # torchao's FP4 code turns NaN into a finite code
            ref = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(v))
        else:
            ref = v.to(FP8[fmt][0]).float()
        _assert_bits_equal(minifloat.round_(v.clone(), fmt), ref)


@pytest.mark.parametrize("fmt", [*FP8, "fp4-e2m1", "mxfp8", "mxfp4", "nvfp4"])
def test_nan_inf_and_all_zero_tensors_as_torchao(fmt):
    """NaN and inf in the input, an all-zero tensor, and a tensor whose max is inf: torchao's values (NaN where
    torchao gives NaN; for FP4 per tensor and NVFP4, torchao's own path where it turns NaN into codes)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=gen)
    x[0, 3], x[1, 40], x[2, 17] = float("nan"), float("inf"), float("-inf")
    finite_inf = torch.randn(4, 64, generator=gen)
    finite_inf[3, 5] = float("inf")
    for v in (x, finite_inf, torch.zeros(4, 64), -torch.zeros(4, 64)):
        if fmt in FP8 or fmt == "fp4-e2m1":
            for scale in (torch.tensor(0.01), torch.full((64,), 0.02)):
                ours, over = fake_fp8(v, scale, fmt) if fmt in FP8 else fake_fp4(v, scale)
                ref, ref_over = _ref_fp8(v, scale, fmt) if fmt in FP8 else _ref_fp4(v, scale)
                _assert_bits_equal(ours, ref)
                assert over == ref_over
        else:
            _assert_bits_equal(fake_block(v, fmt), _ref_block(v, fmt))


@pytest.mark.parametrize("fmt", [*FP8, "fp4-e2m1", "mxfp8", "mxfp4", "nvfp4"])
def test_without_torchao_the_fast_path_gives_the_same_numbers(monkeypatch, fmt):
    """With torchao missing (every torchao module unimportable) the formats run and give the same values."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 64, generator=gen) * torch.exp(torch.randn(3, 4, 64, generator=gen) * 4)
    lo, hi = x.amin() / 3, x.amax() / 3

    def run() -> list[torch.Tensor]:
        if fmt in FP8 or fmt == "fp4-e2m1":
            y, over = fake_quant(x, lo, hi, fmt, True)
            return [y, torch.tensor(over)]
        w = x.reshape(12, 64)
        return [fake_block(x, fmt), *(t for t in quantize_weight_qparams(w, fmt) if t is not None)]

    with_torchao = run()
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import torchao... raises ImportError
    with pytest.raises(ImportError):
        import torchao.prototype.mx_formats.kernels  # noqa: F401
    for ours, ref in zip(run(), with_torchao, strict=True):
        _assert_bits_equal(ours, ref)
