"""Every experiment under experiments/ validates and runs end to end at a tiny budget."""

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import quantgate as qg
from quantgate import experiment as ex
from quantgate.study import load_study, plan, run_study

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p for p in (ROOT / "experiments").glob("*.yaml"))
# committed results come from these; the smoke (first variant of each model) of qiu_table4 and hyga_ablation
# trains the same tiny models as the others, so CI runs those two only with -m slow
RUN_HERE = ["bondarenko_table2", "cpu_recipe", pytest.param("qiu_table4", marks=pytest.mark.slow),
            pytest.param("hyga_ablation", marks=pytest.mark.slow)]
SCRIPTS = ["sink_leak_toy", "massive_activation_intervention", "kv_eviction", "context_extension",
           "cpu_recipe_search"]


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_every_study_validates(path):
    """Paper-scale configs included: a dry run checks keys, presets, variants, schemes and tasks."""
    study = load_study(path)
    text = plan(path)
    assert f"{len(study.cells())} cells" in text
    assert all(c["id"] in text for c in study.cells())


def test_studies_listed_in_readme():
    readme = (ROOT / "experiments" / "README.md").read_text()
    for name in [p.stem for p in STUDIES] + SCRIPTS:
        assert name in readme, f"experiments/README.md does not describe {name}"


@pytest.mark.parametrize("name", RUN_HERE)
def test_study_smoke(name, tmp_path):
    out = run_study(ROOT / "experiments" / f"{name}.yaml", tmp_path / name, smoke=True)
    study = load_study(ROOT / "experiments" / f"{name}.yaml")
    text = (out / "report.md").read_text()
    assert "Bondarenko et al.'s table" in text and "Qiu et al.'s table" in text
    cells = json.loads((out / "metrics.json").read_text())["cells"]
    assert len(cells) == len(study.models)  # first variant and seed of each model
    assert all(c["trained"]["steps"] == 4 for c in cells)
    for c in cells:
        assert c["cost"]["gate_params"] == _added_parameters(c), c["id"]


@pytest.mark.parametrize("name", ["bondarenko_table2", "qiu_table4", "hyga_ablation", "cpu_recipe"])
def test_committed_gate_params_are_what_the_variant_adds(name):
    """The gate parameter counts in results/ (gated cells included, unlike the smoke's first variants)."""
    cells = json.loads((ROOT / "results" / name / "metrics.json").read_text())["cells"]
    for c in cells:
        assert c["cost"]["gate_params"] == _added_parameters(c), c["id"]


def _added_parameters(cell: dict) -> int:
    """Parameters of the cell's model minus those of its vanilla twin."""
    source = cell["source"]

    def count(variant):
        return sum(p.numel() for p in qg.build(source["preset"], variant, **(source["config"] or {})).parameters())

    return count(cell["variant"]) - count("vanilla")


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_smoke(name, tmp_path, monkeypatch):
    """Each script's smoke run, and one or more of its figures recomputed independently."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--smoke", "--out", str(tmp_path)])
    _module(name).main()
    assert (tmp_path / ("search.md" if name == "cpu_recipe_search" else "report.md")).is_file()
    assert any(tmp_path.glob("*.png"))
    SMOKE_CHECKS[name](tmp_path)


def _eager_twin(model, config=None):
    """A plain transformers copy of ``model`` (eager attention, no quantgate code), optionally with ``config``."""
    twin = type(model)._from_config(config or copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _eager_first_token_attention(model, ids):
    """(layers, B, L) attention on key 0, mean over heads, from the probabilities output_attentions returns."""
    with torch.no_grad():
        return torch.stack([a[..., 0].mean(1) for a in _eager_twin(model)(ids, output_attentions=True).attentions])


def _loss_ppl(model, ids, start=1):
    """exp of transformers' own mean loss over the tokens start..L-1."""
    labels = ids.clone()
    labels[:, :start] = -100
    with torch.no_grad():
        return math.exp(model.eval()(input_ids=ids, labels=labels).loss.item())


def _metrics(out):
    return json.loads((out / "metrics.json").read_text())


def _check_sink_leak_toy(out):
    m = _metrics(out)
    for n, leak in m["toy"]["leak"].items():  # gap D = ln(32767 * 0.95 / 0.05): leak = (n-1) / (n-1 + 32767 * 19)
        assert leak == pytest.approx((int(n) - 1) / (int(n) - 1 + 32767 * 19), rel=1e-9)
    model = qg.build("tiny-llama")
    eager = _eager_first_token_attention(model, ex.sequences(qg.tokenizer(model), "test", 64, 2))
    for n, per_layer in m["first_token_attention"].items():
        n = int(n)
        assert per_layer == pytest.approx(eager[:, :, n - 8:n].mean((1, 2)).tolist(), abs=1e-5)


def _check_massive_activation_intervention(out):
    m = _metrics(out)
    assert (m["massive"]["layer"], m["massive"]["channels"], m["massive"]["positions"]) == (0, [0], [0])
    model = qg.build("tiny-llama")
    tok = qg.tokenizer(model)
    with torch.no_grad():
        hidden = model.eval()(ex.sequences(tok, "validation", 32, 2), output_hidden_states=True).hidden_states
    (mean,), = m["mean_value"]  # (positions, channels): block 0's output at token 0, channel 0
    assert mean == pytest.approx(hidden[1][:, 0, 0].mean().item(), abs=1e-6)
    assert m["results"]["original"]["ppl"] == pytest.approx(_loss_ppl(model, ex.sequences(tok, "test", 32, 2)),
                                                            rel=1e-5)


def _check_kv_eviction(out):
    m = _metrics(out)
    for variant in ("vanilla", "g1-elementwise"):
        model = qg.build("tiny-llama", variant)
        ids = ex.sequences(qg.tokenizer(model), "backcopy", 32, 2, seed=1_000_003)
        second_half = _loss_ppl(model, ids, start=16)
        assert m[f"tiny-llama {variant} (random)"]["ppl"]["full"] == pytest.approx(second_half, rel=1e-5)


def _check_context_extension(out):
    rows = _metrics(out)["results"]["vanilla"]
    model = qg.build("tiny-llama")
    tok = qg.tokenizer(model)
    assert rows["16/default"]["ppl"] == pytest.approx(
        _loss_ppl(model, ex.sequences(tok, "backcopy", 16, 2, seed=1_000_003)), rel=1e-5)
    config = copy.deepcopy(model.config)  # linear RoPE interpolation set up by transformers itself
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    assert rows["32/linear"]["ppl"] == pytest.approx(
        _loss_ppl(_eager_twin(model, config), ex.sequences(tok, "backcopy", 32, 2, seed=1_000_003)), rel=1e-5)


def _check_cpu_recipe_search(out):
    """The reported held-out loss, recomputed from the saved model on the training's eval batches (the
    first 2 backcopy batches of seed 1)."""
    for run in sorted((out / "search").iterdir()):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["tokens"] == 6 * 16 * 128
        model = qg.load(run / "train" / "model")
        data = qg.data.batches(qg.tokenizer(model), "backcopy", 128, 16, seed=1)
        with torch.no_grad():
            losses = [model.eval()(**b).loss.item() for _, b in zip(range(2), data)]
        assert summary["final_eval_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)


SMOKE_CHECKS = {"sink_leak_toy": _check_sink_leak_toy, "kv_eviction": _check_kv_eviction,
                "massive_activation_intervention": _check_massive_activation_intervention,
                "context_extension": _check_context_extension, "cpu_recipe_search": _check_cpu_recipe_search}


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sink_leak_toy_reproduces_the_seed():
    toy = _module("sink_leak_toy")
    gap = toy.toy_gap()
    assert gap == pytest.approx(13.34, abs=0.005)  # the seed: "Delta ~ 13.34"
    leaks = [toy.toy_leak(n, gap) for n in toy.TOY_NS]
    assert leaks[:3] == pytest.approx([0.0065, 0.05, 0.174], abs=5e-4)
    assert leaks[3] == pytest.approx(0.6275, abs=5e-5)  # the seed prints 0.628
    assert toy.toy_gap(4096) == pytest.approx(11.3, abs=0.05) and toy.toy_gap(131072) == pytest.approx(14.7, abs=0.05)
    assert toy.implied_gap(1000, toy.toy_leak(1000, 7.0) and 1 - toy.toy_leak(1000, 7.0)) == pytest.approx(7.0)


def test_window_mask_is_a_rolling_cache_with_sinks():
    from quantgate.experiment import window_mask

    m = window_mask(8, 3, sinks=2)[0, 0]
    assert m[7].tolist() == [True, True, False, False, False, True, True, True]
    assert m[2].tolist() == [True, True, True, False, False, False, False, False]
    assert not window_mask(8, 3)[0, 0, 7, :5].any()
