"""The fused CPU kernels (quantgate/quant/fused.py) against the eager reference: bit-identical on fresh random and
outlier-heavy inputs in float32 and bfloat16, for every quantizer they serve, and observe's statistics (moments
within 1e-6); quantizers sharing one input's values; and the eager path when no compiler is found."""

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from typing import Any

import pytest
import torch

from quantgate.observe import TensorStats, _histogram
from quantgate.quant import fused
from quantgate.quant.quantizers import FP8, fake_block, fake_fp4, fake_fp8, int_qparams
from quantgate.quant.schemes import TensorQuant
from quantgate.quant.simulate import ActQuant


@pytest.fixture(scope="module")
def kernels():
    k = fused.kernels()
    if k is None and shutil.which("g++") and os.environ.get("QUANTGATE_COMPILE") != "0":
        pytest.fail(f"a compiler is on PATH but the fused kernels did not build: {fused.status()}")
    if k is None:
        pytest.skip(fused.status())
    return k


def _inputs(shape: tuple[int, ...], family: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if family == "outliers":  # massive activations: token 0 and two channels, as in SmolLM2's residual stream
        x[..., 0, :] *= 300.0
        x[..., min(7, x.shape[-1] - 1)] *= 80.0
        x[..., -3] = -2.4e4
    elif family == "ties":  # halves of the grid: rounding half to even decides them
        x = torch.round(x * 8) / 2
    elif family == "zero-rows":
        x[..., 1, :] = 0.0
    elif family == "special":
        x[..., 0, 0], x[..., 1, 1], x[..., 2, 2] = float("nan"), float("inf"), float("-inf")
    return x


SHAPES = [(1, 16, 64), (2, 33, 96), (1, 128, 576), (3, 5, 7)]
FAMILIES = ["normal", "outliers", "ties", "zero-rows", "special"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal value for value (torch.equal: -0.0 equals 0.0, as in the eager reference's own contract), NaN where
    NaN (its payload aside)."""
    nan = a.isnan()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a[~nan], b[~nan])


def _spec(**kw) -> TensorQuant:
    return TensorQuant(**kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_dynamic_per_token_int_is_the_eager_quantizer_bit_for_bit(kernels, dtype, family, symmetric, bits):
    """Range, torchao's grid and round trip in one call (fused.fake_int_rows) against ActQuant's eager path."""
    aq = ActQuant(_spec(format=f"int{bits}", granularity="token", dynamic=True, symmetric=symmetric), "x")
    for i, shape in enumerate(SHAPES):
        x = _inputs(shape, family, seed=10 * i + symmetric).to(dtype)
        got = aq(x)
        with fused.eager():
            want = aq(x)
        assert _same(got, want), (shape, family)
        rows = fused.minmax_rows(x)
        assert rows is not None
        lo, hi = rows
        assert _same(lo, x.amin(-1, keepdim=True)) and _same(hi, x.amax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_static_int_quantizers_are_the_eager_quantizer_bit_for_bit(kernels, dtype, family, granularity):
    for bits in (8, 4):
        for symmetric in (True, False):
            aq = ActQuant(_spec(format=f"int{bits}", granularity=granularity, symmetric=symmetric), "x")
            calibration = _inputs((2, 16, 96), "outliers" if family == "special" else family, seed=bits)
            aq(calibration)
            aq.freeze()
            x = _inputs((2, 33, 96), family, seed=bits + 1).to(dtype)
            got = aq(x)
            with fused.eager():
                want = aq(x)
            assert _same(got, want), (bits, symmetric)


def test_the_fused_round_trip_is_the_definition():
    """Independent of both paths: (clamp(round(x / s), qmin - z, qmax - z)) * s in float64 on values where float32
    is exact, with s and z from int_qparams."""
    x = torch.tensor([[-3.0, -1.25, 0.0, 0.75, 2.5, 9.0]])
    scale, zero = int_qparams(x.amin(), x.amax(), 4, symmetric=False)
    y = fused.fake_int(x, scale, torch.round(zero), 0, 15)
    if y is None:
        pytest.skip(fused.status())
    s, z = float(scale), float(torch.round(zero))
    want = [(min(max(round(v / s), 0 - z), 15 - z)) * s for v in x.double().flatten().tolist()]
    assert torch.allclose(y.double().flatten(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_without_a_compiler_or_with_compile_0_quantgate_quantizes_on_the_eager_path(tmp_path):
    """A fresh cache and a compiler that is not there: one log line, the eager path, the same numbers; then, in the
    same process started afresh as far as the kernels go, QUANTGATE_COMPILE=0: the eager path and no log line."""
    script = textwrap.dedent("""
        import logging, os, torch
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from quantgate.quant import fused
        from quantgate.quant.schemes import TensorQuant
        from quantgate.quant.simulate import ActQuant
        aq = ActQuant(TensorQuant(format="int8", granularity="token", dynamic=True), "x")
        x = torch.randn(2, 8, 32)
        y = aq(x)
        with fused.eager():
            assert torch.equal(y, aq(x))
        print("STATUS", fused.status(), flush=True)
        fused._why_not = None
        os.environ["QUANTGATE_COMPILE"] = "0"
        print("STATUS", fused.status(), flush=True)
    """)
    env = {**os.environ, "QUANTGATE_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    env.pop("QUANTGATE_COMPILE", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = [line for line in out.stdout.splitlines() if line.startswith("STATUS")]
    assert first.startswith("STATUS eager (the fused quantizer kernels could not be built")
    assert second == "STATUS eager (QUANTGATE_COMPILE=0)"
    assert out.stderr.count("quantizing on the eager path") == 1
    assert not list((tmp_path / "ext").glob("*.so")) and not list((tmp_path / "ext").glob("*-build-*"))


def _scales(x: torch.Tensor) -> list[torch.Tensor]:
    """One scale, one per row of the last dim and one per channel of it (what fake_fp8 / fake_fp4 take)."""
    xf = x.float().nan_to_num(1.0, 1.0, 1.0)
    g = torch.Generator().manual_seed(x.numel())
    per_row = xf.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 100
    per_channel = torch.rand(x.shape[-1], generator=g) * 0.05 + 1e-3
    return [torch.tensor(0.0123), per_row, per_channel]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["fp8-e4m3", "fp8-e5m2", "fp4-e2m1"])
def test_fp8_and_fp4_round_trips_are_the_eager_quantizer_bit_for_bit(kernels, dtype, family, fmt):
    """Values and saturated counts, for a scale per tensor, per row and per channel (small scales: many values
    saturate, others round to subnormals and zero)."""
    for i, shape in enumerate(SHAPES):
        x = _inputs(shape, family, seed=20 * i + len(fmt)).to(dtype)
        for scale in _scales(x):
            got = fake_fp8(x, scale, fmt) if fmt in FP8 else fake_fp4(x, scale)
            with fused.eager():
                want = fake_fp8(x, scale, fmt) if fmt in FP8 else fake_fp4(x, scale)
            assert _same(got[0], want[0]) and got[1] == want[1], (shape, tuple(scale.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_scaled_round_trips_are_the_eager_quantizer_bit_for_bit(kernels, dtype, family, fmt):
    """MX and NVFP4, with a block of tiny values (an MX scale's exponent clamps at -127), and, for NVFP4's
    per-tensor scale, tensors of all zeros and of values below 1e-33 (its scales are not finite: torchao's path)."""
    for i, shape in enumerate([(1, 16, 64), (2, 33, 96), (1, 128, 576)]):
        x = _inputs(shape, family, seed=30 * i).to(dtype)
        x[..., :32] *= 1e-38
        for case in (x, x * 0, x * 1e-30):
            got = fake_block(case, fmt)
            with fused.eager():
                want = fake_block(case, fmt)
            assert _same(got, want), shape


def test_the_fused_fp8_round_trip_is_the_definition():
    """Independent of both paths: e4m3 values are read off the format's own table (every value torch.float8_e4m3fn
    holds), x / s rounded to the nearest (ties: the even code), saturating at 448, times s."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # -448 .. 448
    x = torch.tensor([[0.1, -0.37, 3.3, 1000.0, -2e3, 0.0, 7.0e-4, 9.0, 17.0, 13.0]])
    s = torch.tensor(0.5)
    got = fused.fake_minifloat(x, s, "fp8-e4m3")
    if got is None:
        pytest.skip(fused.status())
    want = []
    for v in (x / s).flatten().tolist():
        d = (grid - v).abs()
        near = grid[d == d.min()]
        codes = near.to(torch.float8_e4m3fn).view(torch.uint8)
        want.append(float(near[codes % 2 == 0][0]) if len(near) > 1 else float(near[0]))
    assert got[0].flatten().tolist() == [w * 0.5 for w in want]
    assert got[1] == 2  # 1000 and -2000 are past 448 * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["normal", "outliers", "ties", "zero-rows"])
def test_observe_statistics_are_the_eager_ones(kernels, dtype, family):
    """Maxima, their positions and channels exactly; the centred moments within 1e-6 relative (float64 sums of the
    same float32 terms); a tensor holding NaN or inf is left to the eager path (None)."""
    for i, shape in enumerate([(1, 16, 64), (2, 33, 96), (3, 128, 576), (1, 5, 7)]):
        x = _inputs(shape, family, seed=40 * i).to(dtype)
        got = fused.tensor_stats(x)
        want = TensorStats._whole_eager(x.float())
        assert got is not None and want is not None
        for a, b in zip(got[:4], want[:4], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), shape
        for a, b in zip(got[4:], want[4:], strict=True):
            assert torch.allclose(a, b, rtol=1e-6, atol=0), shape
    assert fused.tensor_stats(_inputs((1, 16, 64), "special", seed=0).to(dtype)) is None


def test_the_fused_statistics_are_the_definition(kernels):
    """A hand computation: the centred moments of one sequence and its largest |x|, position and channels."""
    x = torch.tensor([[[1.0, -4.0], [2.0, 0.5], [-4.0, 3.0]]])
    stats = fused.tensor_stats(x)
    assert stats is not None
    seq_max, pos, top, cmax, m2, m4 = stats
    mean = sum([1.0, -4.0, 2.0, 0.5, -4.0, 3.0]) / 6
    d = [v - mean for v in [1.0, -4.0, 2.0, 0.5, -4.0, 3.0]]
    assert float(seq_max) == 4.0 and int(pos) == 0  # the first of two tokens holding 4.0
    assert top.tolist() == [2, 1] and cmax.tolist() == [4.0, 4.0]  # token 0: channel 1; tokens 1 and 2: channel 0
    assert float(m2) == pytest.approx(sum(v**2 for v in d), rel=1e-12)
    assert float(m4) == pytest.approx(sum(v**4 for v in d), rel=1e-12)


def test_quantizers_given_one_tensor_share_its_values_and_count_their_own():
    """q, k and v read one tensor: with one spec and range the second and third quantizer take the first one's values
    (the same object), each counting what it quantized; a changed tensor, another spec or another range computes
    afresh, and the shared values die with the tensor."""
    x = _inputs((1, 16, 64), "outliers", seed=5)
    q, k, v = (ActQuant(_spec(format="fp8-e4m3"), n) for n in "qkv")
    for aq in (q, k, v):  # static per-tensor FP8, calibrated on a tenth of x: x saturates
        aq(x / 10)
        aq.freeze()
    yq = q(x)
    assert k(x) is yq and v(x) is yq
    assert q.overflow == k.overflow == v.overflow > 0 and q.values == k.values == v.values == x.numel()
    fresh = ActQuant(_spec(format="fp8-e4m3"), "fresh")
    fresh.load_state_dict(q.state_dict())
    with fused.eager():
        assert torch.equal(fresh(x), yq)
    x.mul_(2.0)  # written in place: its version moves
    y2 = v(x)
    assert y2 is not yq
    with fused.eager():  # computed afresh, not taken from v
        assert torch.equal(y2, fresh(x))
    dynamic = ActQuant(_spec(format="fp8-e4m3", granularity="token", dynamic=True), "dynamic")
    assert dynamic(x) is not y2
    w = ActQuant(_spec(format="fp8-e4m3"), "w")
    w(x * 3)  # another range
    w.freeze()
    assert w(x) is not y2 and not torch.equal(w(x), y2)
    ref = weakref.ref(w(x))
    del x
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_model_gives_the_eager_logits_and_observe_the_eager_report(kernels, dtype):
    """End to end on tiny-llama: every simulated scheme the kernels serve (q/k/v and gate/up sharing their input's
    values on the fused side only), logits bit-identical; observe's report the same but for kurtosis (1e-6)."""
    import quantgate as qg

    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(5, 200, (2, 32), generator=g)} for _ in range(2)]
    model = qg.build("tiny-llama", seed=0).to(dtype).eval()
    for scheme in ("w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "w8a8-mxfp8", "w4a4-fp4-e2m1"):
        options: dict[str, Any] = {"calib": 2} if qg.quant.get_scheme(scheme).needs_calibration else {}
        q = qg.quantize(model, scheme, calibration=batches, **options)
        with torch.no_grad():
            got = q(**batches[0]).logits
            with fused.eager():
                want = q(**batches[0]).logits
        assert torch.equal(got, want), scheme
    got_report = qg.observe(model, batches, progress=False).summary
    with fused.eager():
        want_report = qg.observe(model, batches, progress=False).summary
    assert got_report.kurtosis == pytest.approx(want_report.kurtosis, rel=1e-6)
    assert got_report.max_inf_norm == want_report.max_inf_norm
    assert got_report.max_activation == want_report.max_activation
    assert got_report.max_median_ratio == want_report.max_median_ratio
    assert got_report.sink_mass == want_report.sink_mass


def test_observe_histogram_counts_are_the_eager_ones(kernels):
    """|x| from 1e-14 to 1e12, with every bin edge 10^(-10 + k / 100) and its float32 neighbours (where the
    truncation decides the bin), zeros and values past both ends of the range."""
    edges = 10 ** (torch.arange(-1000, 1001, dtype=torch.float64) / 100)
    edges = edges.float()
    near = torch.cat([torch.nextafter(edges, torch.tensor(0.0)), edges, torch.nextafter(edges, torch.tensor(1e30))])
    g = torch.Generator().manual_seed(7)
    spread = (torch.randn(50_000, generator=g) * 10 ** torch.empty(50_000).uniform_(-14, 12, generator=g)).abs()
    for v in (near, spread, torch.cat([spread, torch.zeros(9), torch.tensor([1e20, 3e38])])):
        got = _histogram(v.clone())
        with fused.eager():
            want = _histogram(v.clone())
        assert torch.equal(got, want) and float(got.sum()) == v.numel()
