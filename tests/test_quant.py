"""Quantization: quantizers against their definitions, schemes on a planted-outlier model, real
kernels, checkpoints and bad input."""

import math
from typing import cast

import pytest
import torch
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.models.record import record_of
from quantgate.quant import get_scheme
from quantgate.quant.error import sqnr_db
from quantgate.quant.quantizers import (
    FP8,
    RangeObserver,
    fake_fp8,
    fake_int,
    fake_quant,
    int_grid,
    int_qparams,
    quantize_weight,
)
from quantgate.quant.simulate import act_quantizers

# --- quantizers by definition -------------------------------------------------------------------


@pytest.mark.parametrize("bits, symmetric", [(8, True), (8, False), (4, False)])
def test_int_round_trip_within_half_a_step_inside_the_range(bits, symmetric):
    lo, hi = torch.tensor(-1.3), torch.tensor(2.7)
    scale, zero = int_qparams(lo, hi, bits, symmetric)
    inside_lo = -float(torch.maximum(lo.abs(), hi.abs())) if symmetric else float(lo)
    x = torch.empty(10_000).uniform_(inside_lo, float(hi))
    err = (fake_int(x, scale, zero, bits, symmetric) - x).abs()
    assert err.max() <= scale / 2 + 1e-6
    qmin, qmax = int_grid(bits, symmetric)
    assert len(torch.unique(torch.round(x / scale) + zero)) <= qmax - qmin + 1


def test_int_saturates_outside_the_range():
    scale, zero = int_qparams(torch.tensor(-1.0), torch.tensor(1.0), 8, True)
    x = torch.tensor([5.0, -7.0, 1.0])
    assert torch.allclose(fake_int(x, scale, zero, 8, True), torch.tensor([1.0, -1.0, 1.0]))
    scale, zero = int_qparams(torch.tensor(-0.5), torch.tensor(1.5), 8, False)
    y = fake_int(torch.tensor([9.0, -9.0]), scale, zero, 8, False)
    assert y[0] == pytest.approx(1.5, abs=scale.item()) and y[1] == pytest.approx(-0.5, abs=scale.item())


@pytest.mark.parametrize("lo, hi", [(-0.37, 5.1), (0.2, 3.0), (-4.0, -1.0), (-1e-3, 7.0)])
def test_asymmetric_zero_is_exact(lo, hi):
    scale, zero = int_qparams(torch.tensor(lo), torch.tensor(hi), 8, False)
    assert zero == torch.round(zero) and 0 <= zero <= 255
    assert fake_int(torch.zeros(3), scale, zero, 8, False).abs().max() == 0  # 0 maps to itself exactly


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_values_are_representable_after_scaling(fmt):
    dtype, fmax = FP8[fmt]
    x = torch.randn(5000) * 3
    scale = x.abs().max() / fmax
    y, overflow = fake_fp8(x, scale, fmt)
    assert overflow == 0
    z = y / scale
    assert torch.equal(z.to(dtype).float(), z)  # already on the FP8 grid: a second round trip is exact
    rel = ((y - x).abs() / x.abs().clamp_min(1e-3))[x.abs() > 0.1]
    assert rel.max() <= 2.0 ** -(4 if fmt == "fp8-e4m3" else 3) + 1e-6  # half an ulp of 3 (2) mantissa bits


def test_fp8_overflow_is_counted_and_saturates():
    scale = torch.tensor(0.01)  # static scale: 448 * 0.01 = 4.48 is the largest representable value
    x = torch.tensor([1.0, 4.0, 5.0, -9.0, 100.0, float("inf")])
    y, overflow = fake_fp8(x, scale, "fp8-e4m3")
    assert overflow == 4
    assert y[2:].abs().tolist() == pytest.approx([4.48] * 4)


def test_percentile_clips_a_planted_outlier_that_minmax_keeps():
    x = torch.randn(200_000)
    x[17] = 1000.0
    obs = {e: RangeObserver(e, percentile=99.99) for e in ("minmax", "percentile")}
    for o in obs.values():
        o.update(x[:100_000])
        o.update(x[100_000:])
    assert float(obs["minmax"].range("int8", False)[1]) == 1000.0
    hi = float(obs["percentile"].range("int8", False)[1])
    assert hi == pytest.approx(float(torch.quantile(x[:16_777_216].float(), 0.9999)), rel=0.02)
    assert hi < 5


def test_running_minmax_is_an_exponential_average():
    o = RangeObserver("running-minmax", momentum=0.9)
    o.update(torch.tensor([-1.0, 2.0]))
    o.update(torch.tensor([-3.0, 4.0]))
    lo, hi = o.range("int8", False)
    assert float(lo) == pytest.approx(0.9 * -1 + 0.1 * -3) and float(hi) == pytest.approx(0.9 * 2 + 0.1 * 4)


@pytest.mark.parametrize("fmt", ["int8", "fp8-e4m3"])
def test_mse_range_beats_minmax_on_heavy_tailed_data(fmt):
    x = torch.distributions.StudentT(3.0).sample((200_000,))

    def error(lo, hi):
        return float((fake_quant(x, lo, hi, fmt, True)[0] - x).square().mean())

    errors = {}
    for est in ("minmax", "mse"):
        o = RangeObserver(est)
        o.update(x)
        errors[est] = error(*o.range(fmt, True))
    amax = x.abs().max()
    brute_force = min(error(-amax * r, amax * r) for r in torch.logspace(-3, 0, 200))
    assert errors["mse"] <= 1.05 * brute_force  # the histogram estimate finds the best clipping range
    if fmt == "int8":
        assert errors["mse"] < 0.7 * errors["minmax"]  # uniform steps: clipping the tail pays off
    else:
        assert errors["mse"] <= errors["minmax"]  # FP8's relative precision: clipping rarely helps


def test_weight_granularities():
    w = torch.randn(6, 16)
    w[2] *= 50  # one loud output channel
    per_tensor = quantize_weight(w, "int8", "tensor")
    per_channel = quantize_weight(w, "int8", "channel")
    assert (per_channel - w).square().sum() < (per_tensor - w).square().sum()
    for row_q, row in zip(per_channel, w, strict=True):  # each channel's largest |w| sits exactly on the grid's end
        assert row_q.abs().max() == pytest.approx(row.abs().max().item(), rel=1e-6)
    grouped = quantize_weight(w, "int4", "group", symmetric=False, group_size=8)
    for g_q, g in zip(grouped.reshape(-1, 8), w.reshape(-1, 8), strict=True):
        assert len(torch.unique(g_q)) <= 16
        assert (g_q - g).abs().max() <= (g.max() - g.min()) / 15 / 2 + 1e-5
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(4, 24), "int4", "group", group_size=16)
    mse = quantize_weight(torch.distributions.StudentT(2.0).sample((4, 512)), "int8", "channel", estimator="mse")
    assert mse.shape == (4, 512)


def test_sqnr_definition():
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0) and sqnr_db(1.0, 0.0) == math.inf


# --- schemes on models ----------------------------------------------------------------------------


def _planted_outlier_model():
    """tiny-llama whose first MLP turns the BOS token into a massive down_proj input (~250 vs ~0.005)."""
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0).eval())
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 3] = 0.0
        emb[1] = 0.0
        emb[1, 3] = 1.0  # BOS points along channel 3, which no other token uses
        mlp = model.model.layers[0].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[5] = 0.0
            proj.weight[5, 3] = 2.0  # intermediate channel 5 fires on BOS only
    return model


def _bos_batches(n, b=4, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.cat(
                [torch.ones(b, 1, dtype=torch.long), torch.randint(5, 8192, (b, t - 1), generator=g)], 1
            )
        }
        for _ in range(n)
    ]


def test_planted_outlier_breaks_static_int8_not_per_token_or_llm_int8():
    model = _planted_outlier_model()
    calib, held_out = _bos_batches(4), _bos_batches(2, seed=1)
    sqnr = {
        s: qg.quant_error(model, qg.quantize(model, s, calibration=calib), held_out).logits_sqnr_db
        for s in ("w8a8-int8-static", "w8a8-int8-dynamic", "llm-int8", "w8a8-fp8-e4m3")
    }
    assert sqnr["w8a8-int8-dynamic"] > sqnr["w8a8-int8-static"] + 15  # per-tensor static error >> per-token
    assert sqnr["llm-int8"] > sqnr["w8a8-int8-static"] + 15  # the outlier decomposition recovers it
    assert sqnr["w8a8-int8-static"] < sqnr["w8a8-fp8-e4m3"] < sqnr["w8a8-int8-dynamic"]  # FP8 in between


def test_site_sensitivity_measures_each_site_alone():
    model = qg.load("twin-vanilla")  # trained (backcopy), so a broken tensor shows in its loss
    tok = qg.tokenizer(model)
    held_out = list(qg.data.batches(tok, "backcopy", 64, 4, max_batches=2, seed=7))
    q = qg.quantize(
        model, "w16a8-int8-bondarenko", calibration=qg.data.batches(tok, "backcopy", 64, 4, seed=3), calib=2
    )

    def loss(m):
        with torch.no_grad():
            return sum(float(m(**b).loss) for b in held_out) / len(held_out)

    before = loss(q)
    clean = qg.quant.site_sensitivity(q, held_out)
    assert clean.none == pytest.approx(loss(model), rel=1e-4)  # W16: all off is the float model (HF sums differ)
    assert clean.all == pytest.approx(before, rel=1e-4) and loss(q) == before  # quantizers back on after
    site = next(m for m in act_quantizers(q) if m.name == "model.layers.0 output")
    site.lo.fill_(-1e-3), site.hi.fill_(1e-3)  # clamp that one tensor to nothing
    broken = qg.quant.site_sensitivity(q, held_out)
    worst = broken.sites[0]
    assert worst.name == site.name and worst.ppl_change > 1 and worst.sqnr_db < 1
    assert worst.low is not None and worst.high is not None
    assert 0 < worst.low <= worst.ppl_change <= worst.high  # its paired interval excludes 0
    assert broken.all_change.ppl_change == pytest.approx(math.exp(broken.all - broken.none) - 1)
    others = {r.name: r.ppl_change for r in clean.sites if r.name != site.name}
    assert {r.name: r.ppl_change for r in broken.sites if r.name != site.name} == pytest.approx(others)
    with pytest.raises(ValueError, match="activation quantizers"):
        qg.quant.site_sensitivity(qg.quantize(model, "w8-int8"), held_out)
    site.hi.fill_(float("nan"))  # a broken range: a clear error, not a NaN change (its NaN reaches the loss)
    with pytest.raises(ValueError, match=r"loss is not finite with .* quantizers on \(model\.layers\.0 output"):
        qg.quant.site_sensitivity(q, held_out)


@pytest.mark.parametrize(
    "scheme",
    [
        "w8a8-int8-static",
        "w8a8-int8-dynamic",
        "w8a8-fp8-e4m3",
        "w8a8-fp8-e5m2",
        "w8-int8",
        "w4-int4-group",
        "w8a8-int8-static:acts=everything",
        "w8a8-int8-static:estimator=mse",
        "w8a8-int8-static:estimator=percentile",
        "w8a8-int8-static:a_granularity=channel,w_granularity=channel",
        "w8a8-fp8-e4m3:dynamic=true",
        "torchao-int8-dynamic",
        "torchao-int8-weight-only",
        "torchao-int8-static",
        "torchao-fp8-weight-only",
        "llm-int8",
    ],
)
@pytest.mark.parametrize("variant", ["g5-output", "hyga+sink"])
def test_every_cpu_scheme_runs_and_reloads_bit_exactly(tmp_path, scheme, variant):
    model = qg.build("tiny-llama", variant, seed=1).eval()
    calib = _bos_batches(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = qg.quantize(model, scheme, calibration=calib)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the source is untouched
    ids = _bos_batches(1, seed=3)[0]["input_ids"]
    err = qg.quant_error(model, q, [{"input_ids": ids}])
    assert 10 < err.logits_sqnr_db < math.inf  # quantized, and still the same model (the gates survive)
    qg.save(q, tmp_path / "q")
    again = qg.load(tmp_path / "q")
    record = qg.quantization_of(again)
    assert record is not None and record.scheme == str(get_scheme(scheme))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)


def test_gpu_only_scheme_names_the_simulated_one():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has an FP8-capable GPU")
    with pytest.raises(RuntimeError, match="w8a8-fp8-e4m3:dynamic=true"):
        qg.quantize(qg.build("tiny-llama"), "torchao-fp8-dynamic")


def test_inplace_and_manifest(tmp_path):
    model = qg.build("tiny-opt")
    same = qg.quantize(model, "w8-int8", inplace=True)
    record = qg.quantization_of(model)
    assert same is model and record is not None and record.scheme == "w8-int8"
    q = qg.quantize(qg.build("tiny-opt"), "w8a8-int8-static", calibration=_bos_batches(3), calib=2, estimator="minmax")
    rec = record_of(q).quantization
    assert rec is not None and rec.calibration is not None and rec.source_sha256 is not None
    assert rec.scheme == "w8a8-int8-static:estimator=minmax,calib=2"
    assert rec.calibration.batches == 2 and rec.source_model == "tiny-opt" and len(rec.source_sha256) == 64
    qg.save(q, tmp_path / "q")
    import json

    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["variant"] == "vanilla"


def test_scheme_strings_round_trip():
    for text in [
        "w8a8-int8-static",
        "w8a8-int8-static:estimator=percentile,percentile=99.9,acts=everything",
        "w4-int4-group:group_size=64",
        "llm-int8:threshold=4.0",
        "torchao-int8-static:calib=4",
        "w8a8-fp8-e5m2:dynamic=true,a_granularity=token",
        "w8-int8:keep=model.layers.0.*|lm_head",
    ]:
        s = get_scheme(text)
        assert get_scheme(str(s)) == s


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("w9a9", "unknown quantization scheme 'w9a9'; valid: w8a8-int8-static"),
        ("w8-int8:estimator=mse", "unknown option 'estimator=mse'; valid:"),
        ("w8a8-int8-static:estimator=magic", "estimator must be one of"),
        ("w8a8-int8-static:a_granularity=token", "per-token activation ranges are dynamic"),
        ("llm-int8:threshold=high", "threshold expects float"),
    ],
)
def test_bad_schemes(text, fragment):
    with pytest.raises(ValueError) as err:
        get_scheme(text)
    assert fragment in str(err.value)


def test_bad_calibration():
    model = qg.build("tiny-llama")
    with pytest.raises(ValueError, match="pass calibration batches"):
        qg.quantize(model, "w8a8-int8-static")
    with pytest.raises(ValueError, match="calibration set is empty"):
        qg.quantize(model, "w8a8-int8-static", calibration=[])
    wrong = [{"input_ids": torch.randint(0, 30_000, (2, 8))}]  # ids from a bigger vocabulary
    with pytest.raises(ValueError, match="another tokenizer"):
        qg.quantize(model, "w8a8-int8-static", calibration=wrong)
    assert qg.quantization_of(model) is None  # nothing happened to the source


def test_corrupt_quantized_checkpoint(tmp_path):
    qg.save(qg.quantize(qg.build("tiny-llama"), "w8-int8"), tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"  # compressed-tensors' layout
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        qg.load(tmp_path / "q")
    f.unlink()
    with pytest.raises(FileNotFoundError, match="quantized checkpoint is incomplete"):
        qg.load(tmp_path / "q")
