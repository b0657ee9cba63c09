"""Any integer bit width (a_bits / w_bits, 2..8) and the torchao primitives behind the simulated quantizers."""

import re

import pytest
import torch

import quantgate as qg
from quantgate.quant import get_scheme, quantizers
from quantgate.quant.quantizers import FP8, fake_quant, int_qparams
from quantgate.quant.schemes import SimulatedScheme
from quantgate.quant.simulate import ActQuant


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
def test_a_bits_gives_the_grid_of_that_width(bits, symmetric):
    scheme = get_scheme(f"w8a8-int8-static:a_bits={bits},a_symmetric={str(symmetric).lower()},estimator=minmax")
    assert isinstance(scheme, SimulatedScheme) and scheme.act is not None
    spec = scheme.act
    ramp = torch.linspace(-2.0, 2.0, 20_001) if symmetric else torch.linspace(-1.0, 3.0, 20_001)
    quant = ActQuant(spec, "ramp")
    quant(ramp)  # calibration
    quant.freeze()
    y = quant(ramp)
    levels = 2**bits - 1 if symmetric else 2**bits
    assert len(torch.unique(y)) == levels
    scale = 4.0 / (2**bits - 2 if symmetric else 2**bits - 1)  # the ramps span 4
    assert float((y - ramp).abs().max()) <= scale / 2 * (1 + 1e-5)


@pytest.mark.parametrize("bits", [2, 3, 5, 7])
def test_w_bits_gives_the_grid_of_that_width(bits):
    q = qg.quantize(qg.build("tiny-llama"), f"w8-int8:w_bits={bits}")
    weight = q.get_submodule("model.layers.0.mlp.down_proj").weight
    assert isinstance(weight, torch.Tensor)
    for row in weight:  # per output channel, symmetric: 2^b - 1 levels
        assert len(torch.unique(row)) <= 2**bits - 1
    record = qg.quantization_of(q)
    assert record is not None and record.scheme == f"w8-int8:w_bits={bits}"


def test_bits_options_parse_print_and_refuse_what_they_cannot_mean():
    s = get_scheme("w8a8-int8-static:a_bits=6,w_bits=4")
    assert isinstance(s, SimulatedScheme) and s.act is not None and s.weight is not None
    assert (s.act.format, s.weight.format) == ("int6", "int4") and get_scheme(str(s)) == s
    assert str(s) == "w8a8-int8-static:a_bits=6,w_bits=4"
    w3 = get_scheme("w4-int4-group:w_bits=3")
    assert isinstance(w3, SimulatedScheme) and w3.weight is not None and w3.weight.format == "int3"
    for text, fragment in [
        ("w8a8-fp8-e4m3:a_bits=6", "fp8-e4m3, a float format of fixed width"),
        ("w8a8-fp8-e5m2:w_bits=4", "fp8-e5m2, a float format of fixed width"),
        ("w8a8-int8-static:a_bits=9", "a_bits must be in [2, 8], got 9"),
        ("w8a8-int8-dynamic:w_bits=1", "w_bits must be in [2, 8], got 1"),
        ("w8-int8:a_bits=4", "unknown option 'a_bits=4'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            get_scheme(text)


# --- library primitives against each other and the formulas ---------------------------------------


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * 3
    yield x, x.amin(), x.amax(), list(x.shape)  # per tensor
    yield x, x.amin(0), x.amax(0), [64, 1]  # per channel (last dim)
    yield x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), [1, 96]  # per token


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_int_equals_torchao_quantize_then_dequantize(bits, symmetric):
    from torchao.quantization import quant_primitives as ao

    qmin, qmax = (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    dtype = torch.int8 if symmetric else torch.uint8
    for x, lo, hi, block in _cases():
        scale, zero = int_qparams(lo, hi, bits, symmetric)
        ours = fake_quant(x, lo, hi, f"int{bits}", symmetric)[0]
        q = ao.quantize_affine(x, block, scale, zero, dtype, qmin, qmax)  # torchao's integer tensor
        assert torch.equal(ours, ao.dequantize_affine(q, block, scale, zero, dtype, qmin, qmax))
        textbook = (torch.clamp(torch.round(x / scale) + zero, qmin, qmax) - zero) * scale  # dividing by the scale
        differs = (ours - textbook).abs() > 1e-6 * scale
        assert differs.float().mean() < 1e-3  # torchao multiplies by 1 / scale: a tie may round the other way
        assert torch.all(((ours - textbook).abs() <= scale * (1 + 1e-5))[differs])


@pytest.mark.parametrize("fmt", ["int8", "int4", *FP8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_without_torchao_the_written_out_formulas_give_the_same_numbers(monkeypatch, fmt, symmetric):
    assert quantizers.ao is not None  # torchao is installed here: the default path uses it
    cases = [(x, lo * r, hi * r) for x, lo, hi, _ in _cases() for r in (1.0, 0.5)]  # 0.5: FP8 saturates
    with_torchao = [fake_quant(x, lo, hi, fmt, symmetric) for x, lo, hi in cases]
    monkeypatch.setattr(quantizers, "ao", None)  # as where torchao is missing
    for (x, lo, hi), (y, overflow) in zip(cases, with_torchao, strict=True):
        y_hand, overflow_hand = fake_quant(x, lo, hi, fmt, symmetric)
        assert torch.equal(y_hand, y) and overflow_hand == overflow
    assert fmt not in FP8 or overflow > 0


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_int_equals_pytorchs_fused_fake_quantize(bits, symmetric, dtype):
    """fake_int is written out for speed: it must give PyTorch's fused kernels' numbers exactly, per tensor, per
    channel and per token, on values that include exact ties (k + 1/2 steps) and values past the range."""
    from quantgate.quant.quantizers import fake_int

    qmin, qmax = (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    for x, lo, hi, _ in _cases():
        scale, zero = int_qparams(lo * 0.7, hi * 0.7, bits, symmetric)  # 0.7: some values saturate
        ties = (torch.randint(-40, 40, x.shape, generator=torch.Generator().manual_seed(1)) + 0.5) * scale
        for v, saturates in ((x.to(dtype), True), (ties.to(dtype), False)):
            z = torch.round(zero).to(torch.int32)
            if scale.numel() == 1:
                fused = torch.fake_quantize_per_tensor_affine(v.float(), scale.reshape(()), z.reshape(()), qmin, qmax)
            else:
                axis = 0 if scale.shape[-1] == 1 else 1
                fused = torch.fake_quantize_per_channel_affine(
                    v.float(), scale.reshape(-1), z.reshape(-1), axis, qmin, qmax
                )
            ours = fake_int(v, scale, zero, bits, symmetric)
            assert ours.dtype == dtype and torch.equal(ours, fused.to(dtype))
            top = (qmax - torch.round(zero)) * scale  # the grid's largest value
            assert (ours <= top.to(dtype)).all() and (not saturates or (v.float() > top).any())
