"""The reference's protocol as options, each checked against its definition (issue 32, item 4): MSE weight
ranges (a grid search over clipping ratios), the percentile inside the running min-max
(``estimator=running-percentile``), the BOS switch (``calib_skip=K``: static activation ranges leave out
the first K positions of each sequence), and a calibration record that counts the batches that ran."""

import logging
import re
from typing import cast

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.models.record import record_of
from quantgate.models.swap import apply_variant
from quantgate.quant import SCHEMES, get_scheme, quantization_of
from quantgate.quant.quantizers import RangeObserver, percentile_range, quantize_weight_qparams
from quantgate.quant.schemes import SimulatedScheme, TensorQuant
from quantgate.quant.simulate import ActQuant, act_quantizers

BOS = 1


def _batches(n, seq=16, batch=2, seed=0):
    """Token batches whose every row starts with the same token, as quantgate's start with BOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, 200, (batch, seq), generator=g)
        ids[:, 0] = BOS
        out.append({"input_ids": ids})
    return out


# --- MSE weight ranges: the grid optimum --------------------------------------------------------------


def _round_trip(w, lo, hi, bits, symmetric):
    """Fake quantization by the formulas (quantizers module docstring), each row with its own range."""
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if symmetric:
        qmin, qmax = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).clamp_min(1e-12)
        zero = torch.zeros_like(scale)
    else:
        qmin, qmax = 0, 2**bits - 1
        scale = ((hi - lo) / (qmax - qmin)).clamp_min(1e-12)
        zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
    q = (torch.clamp(torch.round(w * (1.0 / scale)) + zero, qmin, qmax) - zero) * scale
    return q, scale


@pytest.mark.parametrize(
    "bits, granularity, symmetric",
    [(8, "channel", True), (8, "tensor", True), (4, "channel", True), (4, "group", False), (3, "tensor", False)],
)
def test_mse_weight_range_is_the_brute_force_grid_optimum(bits, granularity, symmetric):
    """w_estimator=mse: of the ranges (r min, r max), r in linspace(0.5, 1, 20), each group takes the one
    whose round trip has the least squared error; brute force over the same grid, group by group."""
    torch.manual_seed(bits)
    w = torch.distributions.StudentT(4.0).sample((12, 64)) * 0.05  # heavy tails: clipping pays off
    w[3, 7] = 1.5  # one outlier row
    group = 16
    q, scale, _ = quantize_weight_qparams(w, f"int{bits}", granularity, symmetric, group, estimator="mse")
    assert scale is not None  # integer formats have one
    rows = {"tensor": w.reshape(1, -1), "channel": w, "group": w.reshape(-1, group)}[granularity]
    best_err, best_q, best_scale = [], [], []
    for row in rows:
        lo, hi = row.min(), row.max()
        trials = []
        for r in torch.linspace(0.5, 1.0, 20):
            rq, rs = _round_trip(row, lo * r, hi * r, bits, symmetric)
            trials.append((float((rq - row).double().square().sum()), rq, rs))
        err, rq, rs = min(trials, key=lambda t: t[0])  # the first of equal errors: the smallest r
        best_err.append(err)
        best_q.append(rq)
        best_scale.append(rs)
    got = q.reshape(rows.shape)
    got_err = (got - rows).double().square().sum(dim=1)
    assert got_err.tolist() == pytest.approx(best_err, rel=1e-6, abs=1e-12)
    torch.testing.assert_close(got, torch.stack(best_q), rtol=0, atol=1e-6)
    torch.testing.assert_close(scale.reshape(-1), torch.stack(best_scale).reshape(-1))
    # and min-max is the grid's r = 1: never better
    minmax, _, _ = quantize_weight_qparams(w, f"int{bits}", granularity, symmetric, group, estimator="minmax")
    assert float((got - rows).square().sum()) <= float((minmax.reshape(rows.shape) - rows).square().sum())


def test_mse_weight_ranges_reach_every_quantized_weight():
    """w_estimator=mse on a model: each quantized Linear's weight is the grid optimum of its own values."""
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0).eval())
    float_w = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    q = cast(LlamaForCausalLM, qg.quantize(model, "w8-int8:w_estimator=mse,w_bits=4"))
    expected, _, _ = quantize_weight_qparams(float_w, "int4", "channel", True, estimator="mse")
    assert torch.equal(q.model.layers[0].mlp.down_proj.weight, expected)
    assert not torch.equal(expected, quantize_weight_qparams(float_w, "int4", "channel", True)[0])  # it clips


# --- the percentile inside the running min-max ------------------------------------------------------


def _ema(values, m):
    r = values[0]
    for v in values[1:]:
        r = m * r + (1 - m) * v
    return r


@pytest.mark.parametrize("p, m", [(99.999, 0.9), (99.0, 0.5), (100.0, 0.0)])
def test_running_percentile_is_the_ema_of_each_batchs_quantiles(p, m):
    torch.manual_seed(1)
    xs = [torch.distributions.StudentT(2.0).sample((3, 5000 + 97 * i)) + i for i in range(5)]
    o = RangeObserver("running-percentile", momentum=m, percentile=p)
    for x in xs:
        o.update(x)
    lo, hi = o.range("int8", False)
    q = torch.tensor([1 - p / 100, p / 100], dtype=torch.float64)
    per_batch = [torch.quantile(x.double().reshape(-1), q) for x in xs]
    assert float(lo) == pytest.approx(float(_ema([b[0] for b in per_batch], m)), rel=1e-5)
    assert float(hi) == pytest.approx(float(_ema([b[1] for b in per_batch], m)), rel=1e-5)
    if p == 100.0:  # the 100th percentile is the max: running-minmax
        ref = RangeObserver("running-minmax", momentum=m)
        for x in xs:
            ref.update(x)
        torch.testing.assert_close(torch.stack([lo, hi]), torch.stack(ref.range("int8", False)))


def test_percentile_range_is_numpys_percentile_beyond_torch_quantiles_limit():
    x = torch.randn(2**24 + 3, generator=torch.Generator().manual_seed(2))
    lo, hi = percentile_range(x, 99.999)
    ref = np.percentile(x.double().numpy(), [100 - 99.999, 99.999])  # linear interpolation, the reference's
    assert (float(lo), float(hi)) == pytest.approx(tuple(ref), rel=1e-6)
    small = x[:1001]
    torch.testing.assert_close(
        torch.stack(percentile_range(small, 97.5)), torch.quantile(small, torch.tensor([0.025, 0.975]))
    )


def test_running_percentile_calibrates_a_model_site_by_its_definition():
    """w16a8 (float weights: calibration runs the float model) with running-percentile: a site's range is
    the EMA of the per-batch percentiles of the tensors it saw, taken here from the float model."""
    batches = _batches(3, seq=24)
    p, m = 99.0, 0.5
    q = qg.quantize(
        qg.build("tiny-llama", seed=0).eval(),
        f"w16a8-int8-bondarenko:estimator=running-percentile,percentile={p},momentum={m}",
        calibration=batches,
        calib=3,
    )
    seen = _capture(qg.build("tiny-llama", seed=0).eval(), batches, ["model.layers.0.mlp.down_proj input"])
    quantile = torch.tensor([1 - p / 100, p / 100], dtype=torch.float64)
    per_batch = [torch.quantile(x.double().reshape(-1), quantile) for x in seen["model.layers.0.mlp.down_proj input"]]
    site = _sites(q)["model.layers.0.mlp.down_proj input"]
    assert float(site.lo) == pytest.approx(float(_ema([b[0] for b in per_batch], m)), rel=1e-4)
    assert float(site.hi) == pytest.approx(float(_ema([b[1] for b in per_batch], m)), rel=1e-4)


# --- the BOS switch -------------------------------------------------------------------------------------


def _spec(skip, estimator="minmax"):
    return TensorQuant("int8", symmetric=False, estimator=estimator, calib_skip=skip)


def _calibrated(quant, xs):
    for x in xs:
        quant(x)
    quant.freeze()
    return float(quant.lo), float(quant.hi)


@pytest.mark.parametrize("k", [1, 2])
def test_calib_skip_leaves_the_first_positions_out_of_the_range(k):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 10, 8, generator=g) for _ in range(3)]
    for x in xs:
        x[:, :k, 3] = 1e4  # planted at the skipped positions
        x[:, :k, 5] = -1e4
    lo, hi = _calibrated(ActQuant(_spec(k), "site", seq_dim=1), xs)
    assert lo == min(float(x[:, k:].min()) for x in xs) and hi == max(float(x[:, k:].max()) for x in xs)
    assert _calibrated(ActQuant(_spec(0), "site", seq_dim=1), xs) == (-1e4, 1e4)
    # the same tensors flattened into (B * N, D) rows, or as (B, 1, N, D), found from the batch's (B, N)
    for shape in ((20, 8), (2, 1, 10, 8)):
        quant = ActQuant(_spec(k), "site")
        quant.tokens = (2, 10)
        assert _calibrated(quant, [x.reshape(shape) for x in xs]) == (lo, hi)
    # attention's (B, H, N, M) scores: the query rows 0..k-1 are dropped, every key column kept
    scores = [torch.randn(2, 4, 10, 10, generator=g) for _ in range(2)]
    for s in scores:
        s[:, :, :k] = 1e4
        s[:, :, k:, 0] = 50.0
    lo, hi = _calibrated(ActQuant(_spec(k), "scores", seq_dim=2), scores)
    assert hi == 50.0 and lo == min(float(s[:, :, k:].min()) for s in scores)


def test_calib_skip_refuses_a_tensor_without_a_sequence_axis_and_sequences_it_empties():
    quant = ActQuant(_spec(1), "model.x input")
    quant.tokens = (2, 10)
    with pytest.raises(ValueError, match=r"model\.x input: calib_skip=1 .* \(7, 8\) tensor has no sequence axis"):
        quant(torch.randn(7, 8))
    short = ActQuant(_spec(3), "model.y input", seq_dim=1)
    short(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="calib_skip=3 left nothing to calibrate on"):
        short.freeze()


def _plant(model, value):
    """The last block writes ``value`` at position 0, channel 0 of its output: it reaches the last block's
    output and the final norm's input at position 0, and no later position (causal attention)."""

    def hook(module, args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[:, 0, 0] = value
        return (h, *out[1:]) if isinstance(out, tuple) else h

    model.model.layers[-1].register_forward_hook(hook)
    return model


def _sites(q):
    return {a.name: a for a in act_quantizers(q)}


def _capture(model, batches, names):
    """The tensors each ``<module> input|output`` site sees in a float forward of ``batches``."""
    apply_variant(model)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    for name in names:
        path, _, where = name.rpartition(" ")
        if where == "input":
            modules[path].register_forward_pre_hook(lambda m, a, n=name: seen[n].append(a[0].detach().clone()))
        else:
            modules[path].register_forward_hook(
                lambda m, a, o, n=name: seen[n].append((o[0] if isinstance(o, tuple) else o).detach().clone())
            )
    with torch.no_grad():
        for b in batches:
            model(**b)
    return seen


def _quantized(value, skip, batches, extra=""):
    model = _plant(qg.build("tiny-llama", seed=0).eval(), value)
    scheme = f"w16a8-int8-bondarenko:estimator=minmax,calib_skip={skip}{extra}"
    return qg.quantize(model, scheme, calibration=batches, calib=len(batches), inplace=True)


def test_bos_switch_on_a_model_a_planted_first_position_sets_no_range():
    batches = _batches(2)
    site = "model.layers.1 output"
    ranges = {
        (v, k): {n: (float(a.lo), float(a.hi)) for n, a in _sites(_quantized(v, k, batches)).items()}
        for v in (1e3, 1e4)
        for k in (0, 1)
    }
    assert ranges[1e3, 0][site][1] == 1e3 and ranges[1e4, 0][site][1] == 1e4  # without the switch it sets it
    assert ranges[1e3, 1] == ranges[1e4, 1]  # with it, no range moves
    assert ranges[1e4, 1][site][1] < 100

    # and each static range is the min / max over positions >= 1 of what the float model feeds the site
    q = _quantized(1e4, 1, batches)
    names = [n for n in _sites(q) if n.endswith((" input", " output"))]
    assert len(names) >= 10 and site in names
    seen = _capture(_plant(qg.build("tiny-llama", seed=0).eval(), 1e4), batches, names)
    for name in names:
        quant = _sites(q)[name]
        lo = min(float(x[:, 1:].min()) for x in seen[name])
        hi = max(float(x[:, 1:].max()) for x in seen[name])
        assert (float(quant.lo), float(quant.hi)) == pytest.approx((lo, hi), rel=1e-5, abs=1e-6), name
    # the scale the site quantizes with follows: asymmetric INT8, [min(lo, 0), max(hi, 0)] over 255 steps
    quant = _sites(q)[site]
    lo, hi = min(float(quant.lo), 0.0), max(float(quant.hi), 0.0)
    scale = (hi - lo) / 255
    x = torch.linspace(lo, hi, 101).reshape(1, 101, 1)
    assert float((quant(x) - x).abs().max()) <= scale / 2 + 1e-6
    assert float(quant(torch.full((1, 1, 1), 1e4))) == pytest.approx(hi, abs=scale)  # the planted value clips
    assert "calibrated from position 1" in repr(quant)


def test_bos_switch_reaches_a_family_that_flattens_its_tokens():
    """OPT's FFN sees (B * N, D) rows: the switch finds the positions from the batch's shape."""
    batches = _batches(2, seq=12)
    scheme = "w16a8-int8-bondarenko:estimator=minmax,calib_skip=2"
    q = qg.quantize(qg.build("tiny-opt", seed=0).eval(), scheme, calibration=batches, calib=2)
    name = "model.decoder.layers.0.fc2 input"
    seen = _capture(qg.build("tiny-opt", seed=0).eval(), batches, [name])
    rows = [x.reshape(2, 12, -1)[:, 2:] for x in seen[name]]
    quant = _sites(q)[name]
    assert (float(quant.lo), float(quant.hi)) == pytest.approx(
        (min(float(r.min()) for r in rows), max(float(r.max()) for r in rows)), rel=1e-5, abs=1e-6
    )


# --- refusals and the scheme string --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("w8a8-int8-dynamic:calib_skip=1", "calib_skip=1 does nothing here: it calibrates static activation ranges"),
        ("w8a8-fp8-e4m3:dynamic=true,calib_skip=1", "calib_skip=1 does nothing here"),
        ("w8a8-int8-dynamic:estimator=running-percentile", "estimator=running-percentile does nothing here"),
        ("w4a4-mxfp4:calib_skip=1", "calib_skip=1 does nothing here: the activations are mxfp4"),
        ("w8-int8:calib_skip=1", "unknown option 'calib_skip=1'"),
        ("kv8-int8:calib_skip=1", "unknown option 'calib_skip=1'"),
        ("torchao-int8-static:calib_skip=1", "unknown option 'calib_skip=1'"),
        ("w8a8-int8-static:calib_skip=-1", "calib_skip must be >= 0"),
        ("w8a8-int8-static:estimator=minmax,momentum=0.5", "estimator=running-minmax reads it, and the estimator is"),
        ("w8a8-int8-static:estimator=mse,percentile=99", "estimator=percentile reads it, and the estimator is mse"),
    ],
)
def test_the_new_options_are_refused_where_nothing_reads_them(text, fragment):
    with pytest.raises(ValueError) as err:
        get_scheme(text)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        "w8a8-int8-bondarenko:w_estimator=mse,estimator=running-percentile,percentile=99.99,calib_skip=1",
        "w8a8-int8-static:estimator=running-percentile,momentum=0.5",
        "w8a8-int8-static:calib_skip=4",
        "w16a8-int8-bondarenko:estimator=percentile,calib_skip=1,a_bits=6",
        "w8a8-fp8-e4m3:calib_skip=1",
    ],
)
def test_the_new_options_print_back(text):
    s = get_scheme(text)
    assert str(s) == text and get_scheme(str(s)) == s


def test_the_record_names_the_options_that_ran():
    q = qg.quantize(qg.build("tiny-llama", seed=0).eval(), "w8a8-int8-static", calibration=_batches(1), calib_skip=1)
    record = quantization_of(q)
    assert record is not None
    scheme = record.scheme
    assert scheme == "w8a8-int8-static:calib_skip=1"
    parsed = get_scheme(scheme)
    assert isinstance(parsed, SimulatedScheme) and parsed.act is not None and parsed.act.calib_skip == 1


# --- the calibration count ----------------------------------------------------------------------------


def test_scheme_descriptions_state_no_calibration_count_of_their_own():
    for name, s in SCHEMES.items():
        assert not re.search(r"\d+ calibration batch", s.description), name
        if "calibration batch" in s.description:
            assert "calib" in s.description.replace("calibration", ""), name


@pytest.mark.parametrize("given, calib, used", [(3, 5, 3), (6, 4, 4), (2, None, 2)])
def test_the_calibration_record_counts_the_batches_that_ran(given, calib, used, caplog):
    model = qg.build("tiny-llama", seed=0).eval()
    options = {} if calib is None else {"calib": calib}
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        q = qg.quantize(model, "w8a8-int8-static", calibration=iter(_batches(given)), **options)
    quantization = record_of(q).quantization
    assert quantization is not None
    record = quantization.calibration
    requested = 16 if calib is None else calib
    assert record is not None and (record.batches, record.requested, record.tokens) == (used, requested, used * 2 * 16)
    short = [r.getMessage() for r in caplog.records if "calibration:" in r.getMessage()]
    if used < requested:
        assert short == [
            f"calibration: {used} batches ran of the {requested} asked for (calib={requested}): the calibration "
            f"set holds no more; the quantization record says {used}"
        ]
    else:
        assert not short
