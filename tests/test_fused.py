"""The fused CPU quantizer kernels (quantgate/quant/fused.py) against the eager reference: bit-identical on fresh
random and outlier-heavy inputs in float32 and bfloat16, for every quantizer they serve; and the eager path when no
compiler is found."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from quantgate.quant import fused
from quantgate.quant.quantizers import int_qparams
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
def test_dynamic_per_token_int8_is_the_eager_quantizer_bit_for_bit(kernels, dtype, family, symmetric):
    aq = ActQuant(_spec(format="int8", granularity="token", dynamic=True, symmetric=symmetric), "x")
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
