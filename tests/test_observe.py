"""observe: every statistic against a hand computation on planted data or an independent path."""

import copy
import importlib
import math
import weakref
from collections import Counter
from typing import TypeVar, cast

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import FAMILY_PRESETS
from transformers import PreTrainedModel

import quantgate as qg
from quantgate.data import batches
from quantgate.models.families import config_of
from quantgate.observe import MassiveActivations, ObserveReport, TensorStats, UnitStats, observe

ob = importlib.import_module("quantgate.observe")  # the module (quantgate.observe is the function)


M = TypeVar("M", bound=nn.Module)


def _module(model: nn.Module, path: str, kind: type[M]) -> M:
    """The submodule at ``path``, of the type the test expects."""
    module = model.get_submodule(path)
    assert isinstance(module, kind), f"{path} is a {type(module).__name__}"
    return module


def test_planted_outlier_channel_and_token():
    x = torch.randn(6, 20, 32)
    x[:, 0, 7] = 500.0  # a massive activation: channel 7, token 0
    ids = torch.randint(10, 100, (6, 20))
    ids[:, 0] = 1
    stats = TensorStats()
    stats.update(x[:3], ids[:3])
    stats.update(x[3:], ids[3:])  # streamed in two batches
    s = stats.summary()
    assert s.inf_norm == pytest.approx(500.0) and s.max_abs == pytest.approx(500.0)
    assert s.max_at_token0 == 1.0 and s.max_positions == [[0, 6]]
    assert s.max_tokens == [[1, 6]]
    assert s.top_channels is not None and s.kurtosis is not None
    assert s.top_channels[0].channel == 7 and s.top_channels[0].max_abs == pytest.approx(500.0)
    # channel 7 holds the token max only at token 0; elsewhere the largest |x| is spread over channels
    assert s.top_channels[0].share_of_token_max == pytest.approx(
        (6 + (x[:, 1:].abs().argmax(-1) == 7).sum().item()) / 120
    )
    flat = x.reshape(6, -1).numpy().astype(np.float64)
    centred = flat - flat.mean(1, keepdims=True)
    kurt = ((centred**4).mean(1) / (centred**2).mean(1) ** 2).mean()  # mu4 / sigma^4 per sequence, averaged
    assert s.kurtosis == pytest.approx(kurt, rel=1e-4)
    median = np.median(np.abs(flat))
    assert s.median_abs == pytest.approx(median, rel=0.025)  # 0.01-decade histogram
    assert s.max_median_ratio == pytest.approx(500.0 / median, rel=0.025)


def test_gaussian_kurtosis_is_three_and_inf_norm_is_the_mean_of_sequence_maxima():
    x = torch.randn(16, 256, 64)
    stats = TensorStats()
    stats.update(x)
    s = stats.summary()
    assert s.kurtosis == pytest.approx(3.0, abs=0.05)
    assert s.inf_norm == pytest.approx(x.abs().amax(dim=(1, 2)).mean().item(), rel=1e-6)
    assert s.median_abs == pytest.approx(0.6745, rel=0.03)  # median of |N(0, 1)|


def test_padding_is_left_out():
    x = torch.randn(2, 10, 8)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    x[1, 6:] = 1e6  # garbage at padded positions
    stats = TensorStats()
    stats.update(x, valid=valid)
    expected = (x[0].abs().max() + x[1, :6].abs().max()) / 2
    assert stats.summary().inf_norm == pytest.approx(expected.item())


def test_nonfinite_values_are_counted_not_averaged():
    x = torch.randn(2, 5, 4)
    x[0, 1, 2] = float("nan")
    x[1, 3, 0] = float("inf")
    stats = TensorStats()
    stats.update(x)
    s = stats.summary()
    assert s.nonfinite == 2 and math.isfinite(s.inf_norm) and s.kurtosis is not None and math.isfinite(s.kurtosis)


def test_massive_activation_criterion():
    x = torch.randn(2, 12, 16) * 0.05  # median |x| ~ 0.034
    x[0, 0, 3] = 150.0  # > 100 and > 1000 x median: massive
    x[1, 5, 9] = 30.0  # > 1000 x median but < 100: not massive
    m = MassiveActivations()
    m.update(x, torch.arange(24).view(2, 12))
    assert m.count == 1
    (entry,) = m.summary()
    assert entry.channel == 3 and entry.positions == [[0, 1]] and entry.tokens == [[0, 1]]


def test_unit_stats():
    u = UnitStats()
    u.update(torch.tensor([[0.05, 0.5, 0.95], [0.2, 0.2, 0.2]]))
    s = u.summary()
    assert s is not None
    assert s.per_head == pytest.approx([0.5, 0.2]) and s.mean == pytest.approx(0.35)
    assert s.below_0_1 == pytest.approx(1 / 6) and sum(s.hist) == pytest.approx(1.0)


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
        _module(model, "model.embed_tokens", nn.Embedding).weight[1] *= 8
    ids = torch.randint(5, 8192, (3, 24))
    ids[:, 0] = 1
    report = observe(model, [{"input_ids": ids}], progress=False)
    expected = _eager_first_key_attention(_plain(model), ids)
    for layer, want in zip(report.layers, expected, strict=True):
        assert layer.sink is not None and layer.sink.per_head == pytest.approx(want.tolist(), abs=1e-5)
    assert report.summary.sink_mass == pytest.approx(float(torch.stack(expected).mean()), abs=1e-5)
    assert (
        report.summary.sink_mass is not None and report.summary.sink_mass > 0.1
    )  # well above uniform (1/24): the planted sink is seen


def _plain(model):
    """The same weights in a plain transformers model (no quantgate attention)."""
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.__dict__.pop("quantgate")
    plain = LlamaForCausalLM(cfg).eval()
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize(
    "preset, variant",
    [
        ("tiny-opt", "g1-headwise:pi_init=0.3"),
        ("tiny-llama", "g2-value"),
        ("tiny-bert", "g1-elementwise:pi_init=0.7"),
        ("tiny-qwen3-next", None),
    ],
)
def test_gate_statistics(preset, variant):
    model = qg.build(preset, variant)
    obj = "mlm" if preset == "tiny-bert" else "clm"
    report = observe(model, batches(qg.tokenizer(model), "validation", 32, 2, obj), max_batches=2, progress=False)
    expected = {"g1-headwise:pi_init=0.3": 0.3, "g2-value": 0.5, "g1-elementwise:pi_init=0.7": 0.7, None: 0.5}[variant]
    assert report.summary.gate_mean == pytest.approx(expected, abs=0.02)  # near pi_init at initialisation
    gate = report.layers[0].gate
    assert gate is not None and len(gate.per_head) == {"g2-value": 2}.get(variant, 4)
    assert report.summary.gate_below_0_1 == 0.0


def test_ungated_model_reports_no_gate_and_every_tensor():
    model = qg.build("tiny-opt")
    report = observe(model, batches(qg.tokenizer(model), "validation", 32, 2), max_batches=2, progress=False)
    assert report.summary.gate_mean is None
    names = set(report.layers[0].tensors)
    assert {
        "block_out",
        "attn_pre_o",
        "attn_out",
        "ffn_out",
        "linear_in.self_attn.q_proj",
        "linear_in.fc1",
        "linear_in.fc2",
        "norm_in.self_attn_layer_norm",
        "norm_in.final_layer_norm",
    } <= names
    assert report.meta.sequences == 4 and report.summary.tokens == 128
    assert report.summary.loss == pytest.approx(math.log(8192), abs=0.2)


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
        _module(model, "model.layers.1.mlp.down_proj", nn.Linear).weight[0, 0] = float("nan")
    report = observe(model, [{"input_ids": torch.randint(5, 8192, (2, 8))}], progress=False)
    where = {(n.layer, n.tensor) for n in report.summary.nonfinite}
    assert (1, "ffn_out") in where and (0, "ffn_out") not in where
    assert "Non-finite activations" in report.markdown()


def test_unsupported_family_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; quantgate families"):
        observe(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), [], progress=False)


def test_empty_data_is_an_error():
    with pytest.raises(ValueError, match="observe got no batches"):
        observe(qg.build("tiny-llama"), [], progress=False)


def test_max_batches_stops_without_pulling_another_batch():
    model = qg.build("tiny-llama")
    pulled, forwards = [], []
    model.get_submodule("model").register_forward_hook(lambda m, a, o: forwards.append(1))

    def stream():
        for i in range(5):
            pulled.append(i)
            yield {"input_ids": torch.randint(5, 8192, (2, 8))}

    report = observe(model, stream(), max_batches=2, progress=False)
    assert len(forwards) == 2 and len(pulled) == 2
    assert report.meta.batches == 2 and report.meta.sequences == 4
    assert observe(model, stream(), progress=False).meta.batches == 5  # no limit: every batch


@pytest.mark.parametrize("preset", [*FAMILY_PRESETS, "tiny-qwen3-next"])
def test_padded_batch_matches_the_sequences_run_one_at_a_time(preset):
    """Right-padded batch (3 x 12; 12, 9 and 5 real tokens) against each sequence alone, unpadded:
    the residual stream from independent block hooks, every tensor and the sink mass from observe."""
    model = qg.build(preset).eval()
    lengths = [12, 9, 5]
    ids = torch.randint(5, 8192, (3, 12))
    mask = (torch.arange(12) < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    blocks = qg.models.families.family_of(model).blocks(model)
    outs = []
    hooks = [
        b.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0])) for b in blocks
    ]
    for i, n in enumerate(lengths):
        with torch.no_grad():
            model(ids[i : i + 1, :n])
    for h in hooks:
        h.remove()
    alone = [observe(model, [{"input_ids": ids[i : i + 1, :n]}], progress=False) for i, n in enumerate(lengths)]
    per_block = [outs[i :: len(blocks)] for i in range(len(blocks))]  # [block][sequence] (n, d)
    report = observe(model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert report.summary.tokens == sum(lengths)
    for layer, seqs in zip(report.layers, per_block, strict=True):
        res = layer.tensors["block_out"]
        assert res.max_abs == pytest.approx(max(float(s.abs().max()) for s in seqs), rel=1e-4)
        assert res.inf_norm == pytest.approx(sum(float(s.abs().max()) for s in seqs) / 3, rel=1e-4)
    # the share of sequences whose largest |x| sits at token 0, in the block that holds the largest |x| of all
    peak = max(per_block, key=lambda seqs: max(float(s.abs().max()) for s in seqs))
    at_0 = [int(s.abs().amax(dim=-1).argmax()) == 0 for s in peak]
    assert report.summary.max_at_token0 == pytest.approx(sum(at_0) / 3)
    causal = preset != "tiny-bert"
    for j, layer in enumerate(report.layers):
        ref = [r.layers[j] for r in alone]
        assert set(layer.tensors) == set(ref[0].tensors)
        for name, t in layer.tensors.items():
            each = [r.tensors[name] for r in ref]
            assert t.sequences == 3, name
            assert t.max_abs == pytest.approx(max(e.max_abs for e in each), rel=1e-4), name
            assert t.inf_norm == pytest.approx(sum(e.inf_norm for e in each) / 3, rel=1e-4), name
            kurtoses = [e.kurtosis for e in each if e.kurtosis is not None]
            assert len(kurtoses) == 3 and t.kurtosis == pytest.approx(sum(kurtoses) / 3, rel=1e-3), name
        queries = [n - causal for n in lengths]  # query 0 sees only the sink key under a causal mask
        sinks = [r.sink for r in ref]
        assert layer.sink is not None and all(s is not None for s in sinks)
        heads = [s.per_head for s in sinks if s is not None]
        sink = [sum(h[i] * q for h, q in zip(heads, queries, strict=True)) / sum(queries) for i in range(len(heads[0]))]
        assert layer.sink.per_head == pytest.approx(sink, abs=1e-5)


def test_token_layouts_map_back_to_batch_and_tokens():
    x = torch.randn(2, 3, 5, 4)  # (B, H, T, d): heads before tokens
    assert torch.equal(ob._by_token(x, 2, 5).reshape(2, 5, -1), x.movedim(2, 1).reshape(2, 5, 12))
    y = torch.randn(2, 5, 3, 4)  # (B, T, H, d)
    assert ob._by_token(y, 2, 5) is y
    z = torch.randn(10, 4)  # (B * T, d)
    assert torch.equal(ob._by_token(z, 2, 5), z.view(2, 5, 4))
    assert ob._by_token(torch.randn(7, 4), 2, 5) is None  # no token axis: measured whole (one "sequence")


@pytest.mark.parametrize("chunk", [100, 1300])  # 6 tokens of one sequence; 2 whole sequences
def test_chunked_statistics_equal_one_pass(monkeypatch, chunk):
    """Folding a tensor in chunks gives the statistics of one pass, padding included."""
    x = torch.randn(3, 40, 16)
    x[1, 17, 5] = 300.0
    ids = torch.randint(10, 100, (3, 40))
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[2, :7] = False  # left padding: positions count real tokens
    x[2, :7] = 1e6
    x[2, 30, 3] = -200.0
    whole = TensorStats()
    whole.update(x, ids, valid)
    monkeypatch.setattr(ob, "CHUNK", chunk)
    chunked = TensorStats()
    chunked.update(x, ids, valid)
    a, b = whole.summary(), chunked.summary()
    for key in ("inf_norm", "max_abs", "kurtosis", "median_abs"):
        assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-9), key
    assert a.max_positions == b.max_positions and a.top_channels == b.top_channels
    positions = Counter([int(x[0].abs().amax(-1).argmax()), 17, 30 - 7])  # row 2: 7 pads before token 30
    assert sorted(map(tuple, b.max_positions)) == sorted(positions.items())
    assert b.max_tokens is not None and dict(b.max_tokens)[int(ids[2, 30])] >= 1
    real = [x[0], x[1], x[2, 7:]]
    flat = [r.reshape(-1).double() for r in real]
    kurt = sum(float(((f - f.mean()) ** 4).mean() / ((f - f.mean()) ** 2).mean() ** 2) for f in flat) / 3
    assert b.kurtosis == pytest.approx(kurt, rel=1e-6)
    assert b.inf_norm == pytest.approx(sum(float(r.abs().max()) for r in real) / 3, rel=1e-7)


def test_hooked_tensors_are_measured_once_and_not_kept_alive(monkeypatch):
    """q/k/v (and gate/up) share one input tensor: one update; an activation dies when the forward pass
    is done with it (observe holds no reference)."""
    model = qg.build("tiny-llama")
    calls, update = [], ob.TensorStats.update

    def counted(self, *args, **kwargs):
        calls.append(id(self))
        return update(self, *args, **kwargs)

    monkeypatch.setattr(ob.TensorStats, "update", counted)
    down_in, alive = [], []
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    down.register_forward_pre_hook(lambda m, a: down_in.append(weakref.ref(a[0])))
    model.get_submodule("model.layers.1.mlp").register_forward_pre_hook(
        lambda m, a: alive.append(down_in[-1]() is not None)
    )
    report = observe(model, [{"input_ids": torch.randint(5, 8192, (2, 8))}], progress=False)
    assert alive == [False]  # layer 0's FFN activation is gone by the time layer 1's FFN runs
    names = sum(len(L.tensors) for L in report.layers)
    # per block, q/k/v share the first norm's output and gate/up the second's (5 repeats); layer 1's first norm
    # reads layer 0's output; the final norm's input and output are two more
    assert len(calls) == len(set(calls)) == names - 5 * len(report.layers) - 1 + 2
    for L in report.layers:
        t = L.tensors
        assert t["linear_in.self_attn.q_proj"] == t["linear_in.self_attn.k_proj"] == t["linear_in.self_attn.v_proj"]
        assert t["linear_in.self_attn.q_proj"].sequences == 2


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bert"])
def test_logits_only_for_the_loss(preset):
    """Without labels the LM head never runs; with labels observe's loss is the model's own loss."""
    model = qg.build(preset).eval()
    ids = torch.randint(5, 8192, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if preset == "tiny-bert":
        labels = labels.masked_fill(torch.rand(ids.shape) > 0.3, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        want = float(model(**batch).loss)
    head = []
    cast(PreTrainedModel, model).get_output_embeddings().register_forward_hook(lambda m, a, o: head.append(1))
    report = observe(model, [batch], progress=False)
    assert report.summary.loss == pytest.approx(want, rel=1e-5) and len(head) == 1
    head.clear()
    report = observe(model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert report.summary.loss is None and head == []


# Bondarenko et al.'s tensors, written out by hand from the reference code (validate_mlm.py, run_clm.py)
PAPER_TENSORS = {
    "tiny-opt": (
        [
            "decoder.layers.{j}",
            "decoder.layers.{j}.fc2",
            "decoder.layers.{j}.self_attn.out_proj",
            "decoder.layers.{j}.self_attn_layer_norm",
            "decoder.layers.{j}.final_layer_norm",
        ],
        ["decoder.final_layer_norm"],
    ),
    "tiny-llama": (
        [
            "layers.{j}",
            "layers.{j}.mlp",
            "layers.{j}.self_attn.o_proj",
            "layers.{j}.input_layernorm",
            "layers.{j}.post_attention_layernorm",
        ],
        ["norm"],
    ),
    "tiny-bert": (["encoder.layer.{j}.output.dense", "encoder.layer.{j}.output.LayerNorm"], []),
}


@pytest.mark.parametrize("preset", sorted(PAPER_TENSORS))
def test_kurtosis_and_inf_norm_over_the_papers_tensors(preset):
    """The headline kurtosis is the mean over the reference's tensors of each tensor's per-sequence kurtosis
    (averaged over sequences); the max inf-norm the largest per-tensor mean of sequence maxima (BERT: the
    LayerNorm inputs too). Computed here with plain hooks on those modules."""
    torch.manual_seed(0)
    model = qg.build(preset)
    obj = "mlm" if preset == "tiny-bert" else "clm"
    data = list(batches(qg.tokenizer(model), "validation", 32, 2, obj, max_batches=2))
    per_block, outer = PAPER_TENSORS[preset]
    names = [n.format(j=j) for j in range(config_of(model).num_hidden_layers) for n in per_block] + outer
    seen: dict[str, list] = {n: [] for n in names}  # per tensor: (sequences, tokens x channels) rows
    ln_in: dict[str, list] = {}
    rows = 0  # sequences in the current batch (OPT's FFN sees (B * T, C))

    def hook(m, a, o, n):
        seen[n].append((o[0] if isinstance(o, tuple) else o).reshape(rows, -1))
        if preset == "tiny-bert" and n.endswith("LayerNorm"):
            ln_in.setdefault(n, []).append(a[0].reshape(rows, -1))

    base = cast(nn.Module, model.base_model)
    handles = [base.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n in names]
    model.eval()
    with torch.no_grad():
        for b in data:
            rows = b["input_ids"].shape[0]
            base(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    for h in handles:
        h.remove()

    def kurt(rows):
        x = torch.cat(rows).double()
        c = x - x.mean(1, keepdim=True)
        return float(((c**4).mean(1) / (c**2).mean(1) ** 2).mean())

    def inf(rows):
        return float(torch.cat(rows).abs().amax(1).double().mean())

    report = observe(model, data, progress=False)
    assert report.summary.kurtosis == pytest.approx(sum(kurt(seen[n]) for n in names) / len(names), rel=1e-4)
    assert report.summary.max_inf_norm == pytest.approx(
        max(inf(r) for r in [*seen.values(), *ln_in.values()]), rel=1e-5
    )
