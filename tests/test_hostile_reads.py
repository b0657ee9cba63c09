"""Issue 57, validated reads: every file quantgate reads back is checked as metrics.json is (eval.json and lm-eval's
results in compare, observe statistics and timings in report, audit.json, cached study steps), and a bad one is
refused in one line naming the file and the field, or (a cached step) computed again; never printed as is."""

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
from conftest import one_line_error

import quantgate as qg
import quantgate.study.compare as compare_module
from quantgate.audit import REFERENCE
from quantgate.audit.record import AuditRecord
from quantgate.cli import main
from quantgate.errors import InputError
from quantgate.study import steps
from quantgate.study.compare import collect_evals
from quantgate.study.records import read_metrics

TASK = "quantgate_ppl"
CELL = "m--vanilla"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(file: Path, change) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def evals(tmp_path_factory) -> Path:
    """A float model and its w8-int8 quantization, each evaluated by `quantgate eval` on two documents of
    quantgate_ppl and quantgate_cloze: ``float/eval.json`` and ``quant/eval.json``."""
    tmp = tmp_path_factory.mktemp("evals")
    qg.save(qg.build("tiny-llama", seed=0), tmp / "m")
    qg.save(qg.quantize(qg.load(tmp / "m"), "w8-int8"), tmp / "q")
    for model, out in (("m", "float"), ("q", "quant")):
        args = ["eval", str(tmp / model), "--tasks", f"{TASK},quantgate_cloze", "--limit", "2", "--out", str(tmp / out)]
        assert main(args) == 0
    return tmp


def _compare_refuses(capsys, runs: list[Path], *wanted: str) -> str:
    assert main(["compare", *map(str, runs)]) == 2
    line = one_line_error(capsys, "compare")
    for w in wanted:
        assert w in line, line
    return line


# --- 1. eval.json edited to an impossible headline ------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "task", "metric", "value"),
    [
        ("perplexity -5", TASK, "word_perplexity", -5),
        ("perplexity NaN", TASK, "word_perplexity", math.nan),
        ("perplexity abc", TASK, "word_perplexity", "abc"),
        ("accuracy 7", "quantgate_cloze", "acc", 7),
    ],
)
def test_compare_refuses_an_eval_json_edited_to_an_impossible_headline(
    case, task, metric, value, evals, tmp_path, capsys
):
    edited = _copy(evals / "quant", tmp_path / "edited")
    _edit(edited / "eval.json", lambda d: d["results"][task].__setitem__(metric, value))
    _compare_refuses(capsys, [evals / "float", edited], str(edited / "eval.json"), f"{task}.{metric}")


def test_compare_reads_the_unedited_eval_json(evals, capsys):
    assert main(["compare", str(evals / "float"), str(evals / "quant")]) == 0
    assert "source sha256" in capsys.readouterr().out


# --- 2. per-document values edited, the headline left alone ----------------------------------------------------


@pytest.mark.parametrize("case", ["loglikelihood -1.0, headline left", "loglikelihood +3 (outside its domain)"])
def test_compare_refuses_per_document_values_the_headline_disagrees_with(case, evals, tmp_path, capsys):
    edited = [_copy(evals / run, tmp_path / run) for run in ("float", "quant")]
    value = -1.0 if "-1.0" in case else 3.0
    for run in edited:  # both runs edited alike: today both showed 5.406e+06 and a change of -100.0%
        _edit(run / "eval.json", lambda d: d["documents"][TASK].__setitem__("loglikelihood", [value, value]))
    _compare_refuses(capsys, edited, "eval.json", f"documents.{TASK}")


# --- 3. lm-eval's own results JSON out of range ------------------------------------------------------------


def _lm_eval_results(folder: Path, acc: object, perplexity: object) -> Path:
    folder.mkdir()
    results = {
        "results": {
            "quantgate_cloze": {"acc,none": acc, "perplexity,none": perplexity, "alias": "quantgate_cloze"},
        },
        "configs": {"quantgate_cloze": {}},
        "versions": {"quantgate_cloze": 1},
        "config": {"model": "hf", "model_args": "pretrained=someone/model"},
    }
    file = folder / "results_2026-01-01T00-00-00.json"
    file.write_text(json.dumps(results))
    return file


@pytest.mark.parametrize(
    ("case", "acc", "perplexity", "field"), [("acc 7", 7, 12.5, "acc"), ("perplexity -1", 0.5, -1, "perplexity")]
)
def test_compare_refuses_lm_eval_results_out_of_range(case, acc, perplexity, field, tmp_path, capsys):
    file = _lm_eval_results(tmp_path / "lm", acc, perplexity)
    _compare_refuses(capsys, [tmp_path / "lm"], str(file), f"quantgate_cloze.{field}")


def test_compare_reads_lm_eval_results_in_range(tmp_path, capsys):
    _lm_eval_results(tmp_path / "lm", 0.5, 12.5)
    assert main(["compare", str(tmp_path / "lm")]) == 0


def test_compare_passes_over_an_unreadable_lm_eval_results_file_beside_a_readable_one(tmp_path):
    _lm_eval_results(tmp_path / "lm", 0.5, 12.5)
    cut = tmp_path / "lm" / "results_2026-01-02T00-00-00.json"
    cut.write_text('{"results": {')  # another tool's file, or one cut off mid-write
    (record,) = collect_evals([tmp_path / "lm"])
    assert record.values["quantgate_cloze/acc"] == 0.5
    (tmp_path / "lm" / "results_2026-01-01T00-00-00.json").unlink()
    with pytest.raises(InputError, match=f"cannot read {cut}"):  # nothing else found: its error, naming it
        collect_evals([tmp_path / "lm"])


def test_a_bug_in_compares_shape_check_is_not_taken_for_an_unreadable_file(tmp_path, monkeypatch):
    """Only the read of an lm-eval results file is allowed to fail (InputError, the file passed over): a plain
    ValueError in what follows is a bug, and keeps its traceback."""
    _lm_eval_results(tmp_path / "lm", 0.5, 12.5)
    (tmp_path / "lm" / "results_2026-01-02T00-00-00.json").write_text(
        (tmp_path / "lm" / "results_2026-01-01T00-00-00.json").read_text()
    )
    shaped = compare_module._lm_eval_shaped
    calls = []

    def bug_on_the_second(data):
        calls.append(data)
        if len(calls) == 2:
            raise ValueError("a bug in the shape check")
        return shaped(data)

    monkeypatch.setattr(compare_module, "_lm_eval_shaped", bug_on_the_second)
    with pytest.raises(ValueError, match="a bug in the shape check"):
        collect_evals([tmp_path / "lm"])


def test_compare_notes_runs_that_read_different_documents(evals, tmp_path, capsys):
    """No change between two runs of different documents: compare says so in a note (the statistics' InputError)."""
    edited = _copy(evals / "quant", tmp_path / "quant")
    _edit(edited / "eval.json", lambda d: d["documents"][TASK].__setitem__("ids", [7, 8]))
    assert main(["compare", str(evals / "float"), str(edited)]) == 0
    assert "cover different documents" in capsys.readouterr().out


def test_a_bug_computing_a_change_is_not_taken_for_different_documents(evals, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug in the change")

    monkeypatch.setattr(compare_module, "change", bug)
    with pytest.raises(ValueError, match="a bug in the change"):
        compare_module.compare([evals / "float", evals / "quant"])


# --- 4. report: observe statistics and timings as edited ---------------------------------------------------------


def _summary(d):
    return d["cells"][0]["observe"]["summary"]


@pytest.mark.parametrize(
    ("case", "change", "field"),
    [
        ("kurtosis abc", lambda d: _summary(d).__setitem__("kurtosis", "abc"), "kurtosis"),
        ("sink mass 5", lambda d: _summary(d).__setitem__("sink_mass", 5), "sink_mass"),
        ("max inf-norm -3", lambda d: _summary(d).__setitem__("max_inf_norm", -3), "max_inf_norm"),
        ("layer sink mass 5", lambda d: d["cells"][0]["observe"]["layers"][0].__setitem__("sink_mass", 5), "sink_mass"),
        ("compute -5 s", lambda d: d["wall_seconds"].__setitem__("steps_total", -5), "steps_total"),
        ("compute abc (a text timing)", lambda d: d["wall_seconds"].__setitem__("steps_total", "abc"), "steps_total"),
        ("cell seconds abc", lambda d: d["cells"][0].__setitem__("seconds", "abc"), "seconds"),
    ],
)
def test_report_refuses_observe_statistics_and_timings_as_edited(case, change, field, study_run, tmp_path, capsys):
    run = _copy(study_run[1], tmp_path / "run")
    before = (run / "report.md").read_text()
    _edit(run / "metrics.json", change)
    assert main(["report", str(run)]) == 2
    line = one_line_error(capsys, "report")
    assert str(run / "metrics.json") in line and field in line, line
    assert (run / "report.md").read_text() == before


# --- 5. audit.json: every field validated on read; never a plan from it ----------------------------------------


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-llama (saved by transformers) audited on 2 passages: the model's folder and the audit's."""
    tmp = tmp_path_factory.mktemp("audit")
    model = qg.build("tiny-llama", seed=0)
    model.save_pretrained(tmp / "tl")  # type: ignore[operator]
    qg.tokenizer(model).save_pretrained(tmp / "tl")
    args = ["--docs", "2", "--budget", "1h", "--within", "50%", "--schemes", REFERENCE, "--no-export"]
    assert main(["audit", str(tmp / "tl"), "--out", str(tmp / "audit"), *args]) == 0
    return tmp / "tl", tmp / "audit"


def test_an_edited_audit_json_does_not_override_the_docs_given(audited, tmp_path, capsys):
    """``docs: 7`` (and text where numbers belong) planted in audit.json, the audit run again with ``--docs 1``:
    the plan is the options' (1 passage), never the file's, and no traceback either way."""
    model, audit = audited
    out = _copy(audit, tmp_path / "audit")
    _edit(out / "audit.json", lambda d: d.update(docs=7, estimate_s="abc", seconds="abc"))
    capsys.readouterr()
    rc = main(["audit", str(model), "--out", str(out), "--docs", "1", "--budget", "1h", "--within", "50%",
               "--schemes", REFERENCE, "--no-export"])  # fmt: skip
    if rc == 2:  # the folder refused (another audit's): in one line, and the file left as it was
        one_line_error(capsys, "audit")
        return
    assert rc == 0 and "Traceback" not in capsys.readouterr().err
    page = (out / "audit.md").read_text()
    assert "1 passages" in page and "7 passages" not in page
    record = AuditRecord.read(out / "audit.json")
    assert record.search_documents.startswith("1 passages")


@pytest.mark.parametrize(
    ("case", "change", "wanted"),
    [
        ("docs 7", lambda d: d.update(docs=7), "docs"),
        ("docs abc", lambda d: d.update(docs="abc"), "docs"),
        ("estimate_s abc", lambda d: d.update(estimate_s="abc"), "estimate_s"),
        ("seconds abc", lambda d: d.update(seconds="abc"), "seconds"),
        ("tolerance 7", lambda d: d.update(tolerance=7), "tolerance"),
        ("budget -5", lambda d: d.update(budget_s=-5), "budget_s"),
        ("a candidate's work abc", lambda d: d["candidates"][0].update(work="abc"), "candidates[0].work"),
        ("a change's n -1", lambda d: d["candidates"][0]["search"].update(n=-1), "candidates[0].search.n"),
    ],
)
def test_audit_json_is_validated_on_read(case, change, wanted, audited, tmp_path):
    file = tmp_path / "audit.json"
    shutil.copy(audited[1] / "audit.json", file)
    assert AuditRecord.read(file).tolerance == 0.5  # as written: read back
    _edit(file, change)
    with pytest.raises(InputError) as e:
        AuditRecord.read(file)
    message = str(e.value)
    assert "\n" not in message and str(file) in message and wanted in message, message


# --- 6. a corrupt cached study step that keeps its key --------------------------------------------------------


def _eval_float(d):
    d["results"][TASK]["word_perplexity"] = -5


def _observe(d):
    d["observe"]["summary"]["kurtosis"] = "abc"


def _scheme(d):
    d["documents"][TASK]["loglikelihood"] = [-1.0 for _ in d["documents"][TASK]["loglikelihood"]]


def _seconds(d):
    d["seconds"] = "abc"


@pytest.mark.parametrize(
    ("case", "step", "change"),
    [
        ("eval-float perplexity -5", "eval-float", _eval_float),
        ("observe kurtosis abc", "observe", _observe),
        ("scheme documents against their headline", "scheme-w8-int8", _scheme),
        ("cost seconds abc", "cost", _seconds),
    ],
)
def test_a_corrupt_cached_step_is_computed_again(case, step, change, study_run, tmp_path, caplog):
    file, original = study_run
    run = _copy(original, tmp_path / "run")
    cached = run / "cells" / CELL / f"{step}.json"
    key = json.loads(cached.read_text())["key"]
    _edit(cached, change)
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        assert main(["study", str(file), "--out", str(run)]) == 0
    said = [r.getMessage() for r in caplog.records if str(cached) in r.getMessage()]
    assert len(said) == 1 and "computing that step again" in said[0], said
    assert json.loads(cached.read_text())["key"] == key  # recomputed under the same key, and valid now
    fresh, old = read_metrics(run), read_metrics(original)
    assert fresh.cells[0].float_results == old.cells[0].float_results
    assert fresh.cells[0].summary == old.cells[0].summary


def test_a_refused_run_leaves_the_previous_metrics_json(study_run, tmp_path, monkeypatch):
    """A step whose new result is not valid: the run stops before metrics.json or report.md is replaced."""
    file, original = study_run
    run = _copy(original, tmp_path / "run")
    before = {name: (run / name).read_bytes() for name in ("metrics.json", "report.md")}
    (run / "cells" / CELL / "eval-float.json").unlink()  # computed again below, wrongly
    evaluate = steps._evaluate

    def wrong(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        out.results[TASK]["word_perplexity"] = -5.0
        return out

    monkeypatch.setattr(steps, "_evaluate", wrong)
    with pytest.raises(InputError, match="word_perplexity"):
        qg.run_study(file, out=run)
    assert {name: (run / name).read_bytes() for name in before} == before
    assert not (run / "cells" / CELL / "eval-float.json").exists()  # nor the step file: it is computed again
