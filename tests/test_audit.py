"""quantgate audit: a generated study that climbs a ladder of schemes, answers first and exports the recipe."""

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_STUDY, one_line_error

import quantgate as qg
from quantgate.audit import LADDER, MIN_DOCS, REFERENCE, AuditError, parse_budget, parse_within
from quantgate.cli import main
from quantgate.study import load_study, run_study
from quantgate.study.grid import LoadSource

FAST: dict[str, Any] = {"budget": "10m", "docs": MIN_DOCS, "progress": False}  # the fewest that give a verdict


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


def _step_files(run: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(run.glob("cells/*/*.json"))}


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
    """tiny-llama saved by plain transformers, audited on the first two rungs within 50%: it stops at the first
    (with a scheme given beyond it, the family test's audit and the early stop's are this one audit)."""
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
    assert change.low <= change.value <= change.high and found.survives_static_int8 == (change.high < 0.5)
    study = load_study(tmp_path / "audit" / "audit.yaml")  # a study file the study machinery reads
    assert study.out == tmp_path / "audit" and [m.name for m in study.models] == [preset]
    assert (tmp_path / "audit" / "report.md").is_file() and (
        tmp_path / "audit" / "audit.md"
    ).read_text() == found.answer


def test_rerunning_the_generated_study_writes_no_step_file(tmp_path):
    folder = _saved("tiny-llama", tmp_path / "m")
    out = tmp_path / "audit"
    found = qg.audit(str(folder), out, schemes=[REFERENCE, "w8a8-int8-dynamic"], within="0.001%", export=False, **FAST)
    before = _step_files(out)
    assert len(before) == 4 + len(found.changes["m"])  # model, observe, eval-float, cost and each rung run
    run_study(out / "audit.yaml")  # its out: is the audit's folder
    assert _step_files(out) == before
    assert main(["audit", str(folder), "--out", str(out), "--docs", str(MIN_DOCS), "--schemes",
                 f"{REFERENCE},w8a8-int8-dynamic", "--within", "0.001%", "--no-export"]) == 0  # fmt: skip
    assert _step_files(out) == before  # the same audit again reuses its documents and steps


def test_stops_at_the_first_rung_within_and_exports_it(llama_audit):
    tmp_path, found = llama_audit
    assert found.recipe == REFERENCE and list(found.changes["tiny-llama"]) == [REFERENCE]  # it did not climb further
    assert found.export == tmp_path / "audit" / "export"
    assert found.export is not None
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


def test_the_twins_are_audited_as_a_pair_with_the_gate_effect(tmp_path, capsys):
    assert main(["audit", "twin-vanilla", "--out", str(tmp_path / "a"), "--docs", "2", "--schemes", REFERENCE]) == 0
    text = capsys.readouterr().out
    assert "**The gate's effect** under `w8a8-int8-static`: twin-g1's change minus twin-vanilla's" in text
    study = load_study(tmp_path / "a" / "audit.yaml")
    assert [m.name for m in study.models] == ["twin-vanilla", "twin-g1"] and study.models[1].variants == [
        "g1-elementwise"
    ]
    assert study.report["pairs"] == [["twin-vanilla", "twin-g1"]]


@pytest.mark.parametrize(
    "case",
    ["not a model", "family", "too large", "budget", "quantized", "scheme", "docs", "hub"],
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
        model, want = "twin-vanilla", "--docs 1: a paired interval needs at least 2 documents"
        args += ["--docs", "1"]
    else:
        model, want = "someone/not-cached", "is not in the local Hugging Face cache"
    assert main(["audit", model, *args]) == 2
    line = one_line_error(capsys, "audit")
    assert want in line, line
    if case == "budget":  # it names a larger budget, a duration --budget reads
        smallest = line.split("give --budget ")[1].split()[0]
        assert parse_budget(smallest) > 1
    assert not (tmp_path / "out" / "audit.yaml").exists()


class _StudyRun(Exception):
    """Raised in place of the audit's first study run: what the audit measured and planned is in its folder."""


def _first_study(monkeypatch, model: str, out: Path) -> Any:
    """The study an audit of ``model`` generates, read from the study file it hands its first run: the audit resolves
    the model, loads it and times it (``_measure``), plans and writes the file; the run itself, the same as any
    folder's (test_audits_a_tiny_model_of_each_family), is left out."""
    audit_module = importlib.import_module("quantgate.audit")
    handed: list[Path] = []

    def first_run(study_file, run_dir):
        handed.append(Path(study_file))
        raise _StudyRun

    monkeypatch.setattr(audit_module, "run_study", first_run)
    with pytest.raises(_StudyRun):
        qg.audit(model, out, schemes=[REFERENCE], export=False, **FAST)
    assert handed == [out / "audit.yaml"]
    return load_study(handed[0])


def test_a_quantized_checkpoint_is_audited_through_its_float_source(tmp_path, monkeypatch):
    folder = _saved("tiny-llama", tmp_path / "float")
    q = qg.quantize(qg.load(folder), "w8a8-int8-dynamic")
    qg.save(q, tmp_path / "q")
    study = _first_study(monkeypatch, str(tmp_path / "q"), tmp_path / "audit")
    assert study.models[0].source == LoadSource(str(folder.resolve()))


def test_a_hub_id_is_audited_from_the_local_cache(tmp_path, monkeypatch):
    """A hub id already in the cache is audited from its snapshot there; nothing is downloaded."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("0" * 40)
    _saved("tiny-llama", snapshot)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    study = _first_study(monkeypatch, "someone/tiny", tmp_path / "audit")
    assert study.models[0].source == LoadSource(str(snapshot.resolve()))


def test_a_second_audit_reuses_the_documents_it_sized_to_the_budget(tmp_path, monkeypatch):
    """Without --docs the number of documents comes from the machine's measured speed; an audit run again with the
    same question reads the same documents (audit.json), so its steps are reused, however busy the machine is now.
    The speed is set here (per token): at 5.9e-3 s, by the plan's sums (base + one rung, each model), 2 of the
    twins' 8 batches fit 10 minutes (3 would take 569 s of its 510); at 7e-3 s, 1 does."""
    audit_module = importlib.import_module("quantgate.audit")  # the module: qg.audit is the function
    speed = {"per_token_s": 5.9e-3}

    def measured(target, settings, dtype, placement):
        return audit_module.Costs(0.1, speed["per_token_s"], audit_module._doc_tokens(settings, None))

    monkeypatch.setattr(audit_module, "_measure", measured)
    ask: dict[str, Any] = {"schemes": [REFERENCE], "export": False, "progress": False}
    first = qg.audit("twin-vanilla", tmp_path / "a", budget="10m", **ask)
    before = _step_files(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "audit.json").read_text())["docs"] == 2
    speed["per_token_s"] = 7e-3  # the machine is busier now
    again = qg.audit("twin-vanilla", tmp_path / "a", budget="10m", **ask)
    assert _step_files(tmp_path / "a") == before
    assert again.changes["twin-vanilla"][REFERENCE].n == first.changes["twin-vanilla"][REFERENCE].n
    targets = [audit_module._target(m, None) for m in ("twin-vanilla", "twin-g1")]
    settings = [audit_module._settings(t, None) for t in targets]
    costs = [measured(t, s, "float32", None) for t, s in zip(targets, settings, strict=True)]
    fresh = audit_module._plan(costs, settings, audit_module._ladder([REFERENCE]), 600, 0)
    assert fresh.docs == 1  # what a fresh plan would read now


def test_given_schemes_are_climbed_in_order_after_the_question_and_tasks_keep_a_perplexity_first():
    audit_module = importlib.import_module("quantgate.audit")
    rungs = audit_module._ladder(["w4-int4-group", "w8-int8", "w8a8-int8-static", "w8-int8"])
    assert [(r.scheme, r.probe) for r in rungs] == [
        (REFERENCE, False),
        ("w4-int4-group", False),  # a probe of the default ladder, climbed here because it was asked for
        ("w8-int8", False),
    ]
    twin = audit_module._target("twin-vanilla", None)
    assert audit_module._settings(twin, ["quantgate_cloze"]).tasks == ["quantgate_backcopy", "quantgate_cloze"]
    assert audit_module._settings(twin, None).tasks == ["quantgate_backcopy"]


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
    audit_module = importlib.import_module("quantgate.audit")
    smollm2 = audit_module.Costs(0.1, 1e-3, [100], widths=frozenset({576, 1536}))
    kept = [r.scheme for r in audit_module._runnable(list(audit_module.LADDER), [smollm2])]
    assert "w4-int4-group" not in kept and kept == [
        r.scheme for r in audit_module.LADDER if r.scheme != "w4-int4-group"
    ]
    llama = audit_module.Costs(0.1, 1e-3, [100], widths=frozenset({512, 1024}))
    assert audit_module._runnable(list(audit_module.LADDER), [llama]) == list(audit_module.LADDER)
    assert (
        qg.quant.get_scheme("w4-int4-group").unfit(frozenset({576}))
        == "its weight groups of 128 do not divide input width 576"
    )
    assert qg.quant.get_scheme("w8a8-int8-static").unfit(frozenset({576})) is None
