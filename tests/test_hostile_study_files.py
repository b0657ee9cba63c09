"""Issue 41 (items 2 and 3): hostile study files and run records.

A study file is read by one bounded YAML reader (:func:`quantgate.yaml_file.read_yaml`): anchors and aliases
(a "billion laughs" file, a recursive alias), duplicate keys and deep nesting are refused, naming the file and
line. A cached step file is reused only when its key is the key computed now. A run's metrics.json is checked
as it is read (:func:`quantgate.study.read_metrics`, so ``quantgate report`` and every other reader): each
evaluation's numbers finite and in range, and the headline agreeing with its per-document values; a hand-edited
file is refused with one line naming the field and the fix.
"""

import json
import math
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from quantgate.study import StudyError, load_study, plan

ROOT = Path(__file__).resolve().parents[1]
TINY = "name: x\nmodels:\n  - name: tiny\n    preset: tiny-llama\n"
QUICKSTART = ROOT / "results" / "quickstart"


class _TooSlow(Exception):
    pass


def _within(seconds: int, fn, *args):
    """``fn(*args)``, failing the test once it has run ``seconds`` (a reader that expands aliases grows without
    bound: this stops it before it takes the machine's memory)."""

    def stop(signum, frame):
        raise _TooSlow(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- item 2: the study file's YAML --------------------------------------------------------------------------


def _billion_laughs() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in "bcdefghij":  # nine levels: 9**9 (387 million) strings once expanded
        previous = chr(ord(level) - 1)
        lines.append(f"{level}: &{level} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + "\nname: x\nmodels: *j\n"


def test_billion_laughs_refused_quickly(tmp_path):
    f = tmp_path / "laughs.yaml"
    f.write_text(_billion_laughs())
    start = time.perf_counter()
    with pytest.raises(StudyError) as err:
        _within(10, plan, f)  # what `quantgate study F --dry-run` runs
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert message.startswith(f"{f}:1: ") and "write the value out" in message, message
    assert "\n" not in message


def test_recursive_alias_refused(tmp_path):
    f = tmp_path / "recursive.yaml"
    f.write_text("name: x\nmodels:\n  - preset: tiny-llama\nvariants: &a [*a]\n")
    with pytest.raises(StudyError) as err:
        _within(10, load_study, f)
    message = str(err.value)
    assert message.startswith(f"{f}:4: ") and "write the value out" in message, message
    # the reader alone, as any other caller would use it
    from quantgate.yaml_file import read_yaml

    with pytest.raises(ValueError, match=r"recursive\.yaml:4: "):
        read_yaml(f)


def test_deep_nesting_refused(tmp_path):
    f = tmp_path / "deep.yaml"
    f.write_text("name: x\nmodels:\n  - preset: tiny-llama\n    config: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(StudyError, match=r"deep\.yaml:4: .*nested more than \d+ levels"):
        _within(10, load_study, f)


def test_duplicate_schemes_key_refused(tmp_path):
    f = tmp_path / "twice.yaml"
    f.write_text(TINY + "schemes: [w8a8-int8-static]\neval: {limit: 2}\nschemes: [w8a8-int8-dynamic]\n")
    with pytest.raises(StudyError) as err:
        load_study(f)
    message = str(err.value)
    assert message.startswith(f"{f}:7: ") and "'schemes'" in message and "line 5" in message, message


def test_duplicate_keys_refused_anywhere(tmp_path):
    f = tmp_path / "nested.yaml"
    f.write_text(TINY + "    train: {steps: 2, lr: 0.01,\n            steps: 3}\n")
    with pytest.raises(StudyError, match=r"nested\.yaml:6: key 'steps' is given twice \(first at line 5\)"):
        load_study(f)


def _committed_studies() -> list[Path]:
    return sorted(
        [
            *(ROOT / "experiments").glob("*.yaml"),
            *(ROOT / "quantgate" / "studies").glob("*.yaml"),
            *(ROOT / "results").glob("*/config.yaml"),
            *(ROOT / "results").glob("twins_search/*/*/*.yaml"),
        ]
    )


def test_committed_study_files_read_as_before():
    """Every committed study YAML (experiments/, the packaged studies, the runs' resolved copies) reads with the
    bounded reader into what PyYAML reads; the study files load through plan()."""
    from quantgate.yaml_file import read_yaml

    files = _committed_studies()
    assert len(files) > 20
    for f in files:
        data, lines = read_yaml(f)
        assert data == yaml.safe_load(f.read_text()), f
        assert lines[()] >= 1
    for f in [*(ROOT / "experiments").glob("*.yaml"), ROOT / "quantgate" / "studies" / "quickstart.yaml"]:
        assert plan(f).startswith("study "), f


# --- item 3: cached steps and run records -------------------------------------------------------------------


def test_step_file_with_null_key_not_reused(tmp_path):
    from quantgate.study.steps import _done

    path = tmp_path / "eval-float.json"
    path.write_text(json.dumps({"key": None, "results": {}, "documents": {}, "seconds": 1.0, "format": 1}))
    assert _done(path, "0123456789abcdef", ("results", "documents")) is None
    path.write_text(json.dumps({"results": {}, "documents": {}, "seconds": 1.0}))  # no key at all
    assert _done(path, "0123456789abcdef", ("results", "documents")) is None
    path.write_text(json.dumps({"key": "0123456789abcdef", "results": {}, "documents": {}, "seconds": 1.0}))
    assert _done(path, "0123456789abcdef", ("results", "documents")) == {
        "key": "0123456789abcdef",
        "results": {},
        "documents": {},
        "seconds": 1.0,
    }


def test_step_file_that_is_not_json_is_computed_again(tmp_path, caplog):
    from quantgate.study.steps import _done

    path = tmp_path / "eval-float.json"
    path.write_text('{"key": "0123456789abcdef", "results": {')  # cut off mid-write
    with caplog.at_level("WARNING", logger="quantgate"):
        assert _done(path, "0123456789abcdef", ("results", "documents")) is None
    assert f"cannot read {path}" in caplog.text and "computing that step again" in caplog.text


def test_a_bug_reading_a_step_file_is_not_taken_for_a_corrupt_file(tmp_path, monkeypatch):
    """Only read_json's refusal (InputError) means "compute the step again": a plain ValueError is a bug."""
    from quantgate.study import steps

    def bug(*args, **kwargs):
        raise ValueError("a bug in the reader")

    path = tmp_path / "eval-float.json"
    path.write_text(json.dumps({"key": "0123456789abcdef", "results": {}, "documents": {}, "seconds": 1.0}))
    monkeypatch.setattr(steps, "read_json", bug)
    with pytest.raises(ValueError, match="a bug in the reader"):
        steps._done(path, "0123456789abcdef", ("results", "documents"))


def test_a_step_record_that_refuses_means_compute_again_and_a_bug_in_it_propagates(tmp_path, caplog):
    """A cached step whose record refuses it (RecordError: a field of another kind) is computed again; a TypeError
    from the record's own code is a bug and keeps its traceback (it is no longer taken for a corrupt file)."""
    from quantgate.study import steps
    from quantgate.study.records import Evaluated

    path = tmp_path / "eval-float.json"
    path.write_text(json.dumps({"key": "0123456789abcdef", "results": [], "documents": {}, "seconds": 1.0}))
    with caplog.at_level("WARNING", logger="quantgate"):
        assert steps._done(path, "0123456789abcdef", ("results", "documents"), 1, Evaluated.from_json) is None
    assert "results" in caplog.text and "computing that step again" in caplog.text

    def bug(data):
        raise TypeError("a bug in the record")

    path.write_text(json.dumps({"key": "0123456789abcdef", "results": {}, "documents": {}, "seconds": 1.0}))
    with pytest.raises(TypeError, match="a bug in the record"):
        steps._done(path, "0123456789abcdef", ("results", "documents"), 1, bug)


def _run_copy(tmp_path: Path, edit, source: Path = QUICKSTART) -> Path:
    """A copy of a committed run (the quickstart's) whose metrics.json ``edit`` changed in place."""
    run = tmp_path / "run"
    run.mkdir()
    data = json.loads((source / "metrics.json").read_text())
    edit(data)
    (run / "metrics.json").write_text(json.dumps(data, indent=1))
    return run


def _report_error(run: Path, capsys) -> str:
    from quantgate.cli import main

    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not (run / "report.md").exists(), err
    assert "restore" in err and "quantgate study" in err, err
    return err


def _set_ppl(value):
    def edit(data):
        data["cells"][0]["float"]["quantgate_passages"]["word_perplexity"] = value

    return edit


def test_report_refuses_negative_perplexity(tmp_path, capsys):
    err = _report_error(_run_copy(tmp_path, _set_ppl(-5)), capsys)
    assert "cells[0].float.quantgate_passages.word_perplexity" in err and "-5" in err, err


def test_report_refuses_text_perplexity(tmp_path, capsys):
    err = _report_error(_run_copy(tmp_path, _set_ppl("abc")), capsys)
    assert "cells[0].float.quantgate_passages.word_perplexity" in err and "'abc'" in err, err


def test_report_refuses_nan_perplexity(tmp_path, capsys):
    err = _report_error(_run_copy(tmp_path, _set_ppl(math.nan)), capsys)
    assert "cells[0].float.quantgate_passages.word_perplexity" in err and "nan" in err, err


def test_report_refuses_negative_bits_per_byte(tmp_path, capsys):
    def edit(data):
        data["cells"][0]["schemes"]["w8a8-int8-static"]["results"]["quantgate_passages"]["bits_per_byte"] = -0.5

    err = _report_error(_run_copy(tmp_path, edit), capsys)
    assert "cells[0].schemes.w8a8-int8-static.results.quantgate_passages.bits_per_byte" in err, err


def test_report_refuses_accuracy_out_of_range(tmp_path, capsys):
    def edit(data):
        data["cells"][1]["float"]["quantgate_backcopy"]["copy_acc"] = 1.5

    err = _report_error(_run_copy(tmp_path, edit, ROOT / "results" / "cpu_recipe"), capsys)
    assert "cells[1].float.quantgate_backcopy.copy_acc" in err and "[0, 1]" in err, err


def test_report_refuses_inconsistent_per_document_values(tmp_path, capsys):
    def every_column(data):  # the edit: every per-document list replaced by [-1.0]
        docs = data["cells"][0]["schemes"]["w8a8-int8-static"]["documents"]["quantgate_passages"]
        for column in docs:
            docs[column] = [-1.0]

    err = _report_error(_run_copy(tmp_path, every_column), capsys)
    assert "cells[0].schemes.w8a8-int8-static.documents.quantgate_passages." in err, err

    def scaled(data):  # well-formed values that are not those the headline was computed from
        docs = data["cells"][2]["float_documents"]["quantgate_backcopy"]
        docs["loglikelihood"] = [2 * x for x in docs["loglikelihood"]]

    shutil.rmtree(tmp_path / "run")
    err = _report_error(_run_copy(tmp_path, scaled), capsys)
    assert "cells[2].float.quantgate_backcopy.perplexity" in err and "per-document" in err, err


def _set(path: tuple, value):
    def edit(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("path", "value", "wanted"),
    [
        (("cells",), None, "cells is null, not an array"),
        (("cells", 0), None, "cells[0] is null, not a JSON object"),
        (("cells", 0, "schemes"), None, "cells[0].schemes is null, not an object"),
        (("cells", 0, "schemes", "w8a8-int8-static"), [], "cells[0].schemes.w8a8-int8-static is a JSON array, not an"),
        (("cells", 0, "float_documents"), None, "cells[0].float_documents is null, not an object"),
        (("cells", 0, "float", "quantgate_passages", "word_perplexity"), 10**400, "quantgate_passages.word_perplexity"),
    ],
    ids=["cells null", "cell null", "schemes null", "scheme an array", "documents null", "perplexity 10**400"],
)
def test_report_refuses_nulls_and_wrong_kinds_naming_the_field(path, value, wanted, tmp_path, capsys):
    """The typed reader refuses a null or an array where its record wants an object, naming the field (it raised
    TypeError or AttributeError, which a broad catch turned into "not a study's metrics.json"), and a number past a
    float's range (OverflowError)."""
    err = _report_error(_run_copy(tmp_path, _set(path, value)), capsys)
    assert wanted in err, err


@pytest.mark.parametrize("error", [ValueError, TypeError])
def test_a_bug_reading_metrics_json_is_not_taken_for_a_bad_file(error, monkeypatch):
    """wrong_metrics catches the typed reader's refusals (InputError) only: a bug inside the reader keeps its
    traceback instead of reading as "not a study's metrics.json"."""
    from quantgate.study import records

    def bug(*args, **kwargs):
        raise error("a bug in the reader")

    data = json.loads((QUICKSTART / "metrics.json").read_text())
    assert records.wrong_metrics(data) is None
    monkeypatch.setattr(records, "keyed", bug)  # called as each cell is read
    with pytest.raises(error, match="a bug in the reader"):
        records.wrong_metrics(data)


def test_committed_runs_pass_validation_and_rebuild(tmp_path):
    """Every committed study run reads (validated); the quickstart's report rebuilds from a copy."""
    from quantgate.study import read_metrics
    from quantgate.study.report import Report

    runs = [p.parent for p in (ROOT / "results").glob("**/metrics.json") if "cells" in json.loads(p.read_text())]
    assert len(runs) >= 10
    for run in runs:
        assert read_metrics(run).cells, run
    run = tmp_path / "quickstart"
    run.mkdir()
    shutil.copy(QUICKSTART / "metrics.json", run / "metrics.json")
    assert Report.of(read_metrics(run)).markdown() == (QUICKSTART / "report.md").read_text()
