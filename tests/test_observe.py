"""observe: every statistic against a hand computation on planted data or an independent path."""

import copy
import math

import numpy as np
import pytest
import torch

import quantgate as qg
from quantgate.data import batches
from quantgate.observe import MassiveActivations, ObserveReport, TensorStats, UnitStats, observe


def test_planted_outlier_channel_and_token():
    x = torch.randn(6, 20, 32)
    x[:, 0, 7] = 500.0  # a massive activation: channel 7, token 0
    ids = torch.randint(10, 100, (6, 20))
    ids[:, 0] = 1
    stats = TensorStats()
    stats.update(x[:3], ids[:3])
    stats.update(x[3:], ids[3:])  # streamed in two batches
    s = stats.summary()
    assert s["inf_norm"] == pytest.approx(500.0) and s["max_abs"] == pytest.approx(500.0)
    assert s["max_at_token0"] == 1.0 and s["max_positions"] == [[0, 6]]
    assert s["max_tokens"] == [[1, 6]]
    assert s["top_channels"][0]["channel"] == 7 and s["top_channels"][0]["max_abs"] == pytest.approx(500.0)
    # channel 7 holds the token max only at token 0; elsewhere the largest |x| is spread over channels
    assert s["top_channels"][0]["share_of_token_max"] == pytest.approx((6 + (x[:, 1:].abs().argmax(-1) == 7).sum().item()) / 120)
    flat = x.reshape(6, -1).numpy().astype(np.float64)
    centred = flat - flat.mean(1, keepdims=True)
    kurt = ((centred**4).mean(1) / (centred**2).mean(1) ** 2).mean()  # mu4 / sigma^4 per sequence, averaged
    assert s["kurtosis"] == pytest.approx(kurt, rel=1e-4)
    median = np.median(np.abs(flat))
    assert s["median_abs"] == pytest.approx(median, rel=0.025)  # 0.01-decade histogram
    assert s["max_median_ratio"] == pytest.approx(500.0 / median, rel=0.025)


def test_gaussian_kurtosis_is_three_and_inf_norm_is_the_mean_of_sequence_maxima():
    x = torch.randn(16, 256, 64)
    stats = TensorStats()
    stats.update(x)
    s = stats.summary()
    assert s["kurtosis"] == pytest.approx(3.0, abs=0.05)
    assert s["inf_norm"] == pytest.approx(x.abs().amax(dim=(1, 2)).mean().item(), rel=1e-6)
    assert s["median_abs"] == pytest.approx(0.6745, rel=0.03)  # median of |N(0, 1)|


def test_padding_is_left_out():
    x = torch.randn(2, 10, 8)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    x[1, 6:] = 1e6  # garbage at padded positions
    stats = TensorStats()
    stats.update(x, valid=valid)
    expected = (x[0].abs().max() + x[1, :6].abs().max()) / 2
    assert stats.summary()["inf_norm"] == pytest.approx(expected.item())


def test_nonfinite_values_are_counted_not_averaged():
    x = torch.randn(2, 5, 4)
    x[0, 1, 2] = float("nan")
    x[1, 3, 0] = float("inf")
    stats = TensorStats()
    stats.update(x)
    s = stats.summary()
    assert s["nonfinite"] == 2 and math.isfinite(s["inf_norm"]) and math.isfinite(s["kurtosis"])


def test_massive_activation_criterion():
    x = torch.randn(2, 12, 16) * 0.05  # median |x| ~ 0.034
    x[0, 0, 3] = 150.0  # > 100 and > 1000 x median: massive
    x[1, 5, 9] = 30.0  # > 1000 x median but < 100: not massive
    m = MassiveActivations()
    m.update(x, torch.arange(24).view(2, 12))
    assert m.count == 1
    (entry,) = m.summary()
    assert entry["channel"] == 3 and entry["positions"] == [[0, 1]] and entry["tokens"] == [[0, 1]]


def test_unit_stats():
    u = UnitStats()
    u.update(torch.tensor([[0.05, 0.5, 0.95], [0.2, 0.2, 0.2]]))
    s = u.summary()
    assert s["per_head"] == pytest.approx([0.5, 0.2]) and s["mean"] == pytest.approx(0.35)
    assert s["below_0.1"] == pytest.approx(1 / 6) and sum(s["hist"]) == pytest.approx(1.0)


def _eager_first_key_attention(model, ids):
    """Independent reference: transformers' own eager attention with output_attentions."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions  # per layer (B, H, N, N)
    return [a[:, :, 1:, 0].mean(dim=(0, 2)) for a in att]  # queries 1.. (query 0 sees only key 0)


def test_sink_mass_per_head_equals_eager_attention_probabilities():
    torch.manual_seed(0)
    model = qg.build("tiny-llama").eval()
    with torch.no_grad():  # make the first key attractive so the numbers are not all ~1/N
        model.model.embed_tokens.weight[1] *= 8
    ids = torch.randint(5, 8192, (3, 24))
    ids[:, 0] = 1
    report = observe(model, [{"input_ids": ids}], progress=False)
    expected = _eager_first_key_attention(_plain(model), ids)
    for layer, want in zip(report.layers, expected):
        assert layer["sink"]["per_head"] == pytest.approx(want.tolist(), abs=1e-5)
    assert report.summary["sink_mass"] == pytest.approx(float(torch.stack(expected).mean()), abs=1e-5)
    assert report.summary["sink_mass"] > 0.1  # well above uniform (1/24): the planted sink is seen


def _plain(model):
    """The same weights in a plain transformers model (no quantgate attention)."""
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.__dict__.pop("quantgate")
    plain = LlamaForCausalLM(cfg).eval()
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize("preset, variant", [("tiny-opt", "g1-headwise:pi_init=0.3"), ("tiny-llama", "g2-value"),
                                             ("tiny-bert", "g1-elementwise:pi_init=0.7"), ("tiny-qwen3-next", None)])
def test_gate_statistics(preset, variant):
    model = qg.build(preset, variant)
    obj = "mlm" if preset == "tiny-bert" else "clm"
    report = observe(model, batches(qg.tokenizer(model), "validation", 32, 2, obj), max_batches=2, progress=False)
    expected = {"g1-headwise:pi_init=0.3": 0.3, "g2-value": 0.5, "g1-elementwise:pi_init=0.7": 0.7, None: 0.5}[variant]
    assert report.summary["gate_mean"] == pytest.approx(expected, abs=0.02)  # near pi_init at initialisation
    assert len(report.layers[0]["gate"]["per_head"]) == {"g2-value": 2}.get(variant, 4)
    assert report.summary["gate_below_0.1"] == 0.0


def test_ungated_model_reports_no_gate_and_every_tensor():
    model = qg.build("tiny-opt")
    report = observe(model, batches(qg.tokenizer(model), "validation", 32, 2), max_batches=2, progress=False)
    assert report.summary["gate_mean"] is None
    names = set(report.layers[0]["tensors"])
    assert {"block_out", "attn_pre_o", "attn_out", "ffn_out", "linear_in.self_attn.q_proj", "linear_in.fc1",
            "linear_in.fc2", "norm_in.self_attn_layer_norm", "norm_in.final_layer_norm"} <= names
    assert report.meta["sequences"] == 4 and report.summary["tokens"] == 128
    assert report.summary["loss"] == pytest.approx(math.log(8192), abs=0.2)


def test_observe_leaves_the_model_unchanged_and_reports_round_trip(tmp_path):
    model = qg.build("tiny-qwen3", "hyga+sink")
    ids = torch.randint(5, 8192, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    report = observe(model, [{"input_ids": ids}], progress=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert all(a.qg_observer is None for a in qg.models.attention_modules(model))
    report.save(tmp_path)
    for name in ("observe.json", "observe.md", "observe_layers.png", "observe_sink.png", "observe_gates.png"):
        assert (tmp_path / name).stat().st_size > 0
    again = ObserveReport.load(tmp_path)
    assert again.summary == report.summary and again.markdown() == report.markdown()


def test_nan_activations_are_reported_with_layer_and_tensor():
    model = qg.build("tiny-llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    report = observe(model, [{"input_ids": torch.randint(5, 8192, (2, 8))}], progress=False)
    where = {(n["layer"], n["tensor"]) for n in report.summary["nonfinite"]}
    assert (1, "ffn_out") in where and (0, "ffn_out") not in where
    assert "Non-finite activations" in report.markdown()


def test_unsupported_family_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; quantgate families"):
        observe(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), [], progress=False)


def test_empty_data_is_an_error():
    with pytest.raises(ValueError, match="observe got no batches"):
        observe(qg.build("tiny-llama"), [], progress=False)
