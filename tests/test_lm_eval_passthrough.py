"""Issue 41 (items 5 and 8a): ``quantgate lm-eval`` refuses non-finite results for every model type and an
unwritable --output_path before the work; ``quantgate compare`` refuses a --baseline whose sha256 disagrees
with a quantized run's recorded source (unless --force-baseline, stated), refuses to pair runs whose lm-eval
settings change the numbers (few-shot), and shows every metric a task reports (cloze perplexity beside acc)."""

import errno
import json
import logging
from pathlib import Path
from typing import cast

import pytest
import torch
from transformers import LlamaForCausalLM

import quantgate as qg
import quantgate.files as files
from quantgate.cli import main
from quantgate.study.compare import collect_evals, compare

CLOZE = "quantgate_cloze"


def _lm_eval_argv(model_dir: Path, out: Path, tasks: str = "quantgate_ppl,quantgate_cloze") -> list[str]:
    return [
        "lm-eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=float32",
        "--device",
        "cpu",
        "--tasks",
        tasks,
        "--limit",
        "2",
        "--output_path",
        str(out),
    ]


def test_lm_eval_passthrough_hf_nan_model_refused(tmp_path, monkeypatch, capsys):
    """``--model hf`` on a folder whose weights make every output NaN: lm-eval itself would write
    ``word_perplexity NaN`` (and cloze acc 0, from NaN log-likelihoods) and exit 0. Now: one line naming the
    task and metric, exit non-zero, no results file compare would read; what was computed is kept aside."""
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model_dir = qg.save(model, tmp_path / "nan_model")
    monkeypatch.setattr(logging, "raiseExceptions", False)  # lm-eval's handlers may outlive a captured stream
    out = tmp_path / "out"
    assert main(_lm_eval_argv(model_dir, out)) == 2
    captured = capsys.readouterr()
    error = captured.err.strip().splitlines()[-1]
    assert error.startswith("quantgate lm-eval: error: ") and "Traceback" not in captured.err
    assert "quantgate_ppl" in error and "word_perplexity" in error and "nan" in error.lower()
    assert not list(out.rglob("results_*.json"))  # nothing compare would take for a run
    partial = sorted(out.rglob("*.partial.json"))
    assert len(partial) == 1 and str(partial[0]) in error  # what was computed, kept and named
    kept = json.loads(partial[0].read_text())
    assert set(kept["results"]) == {"quantgate_ppl", CLOZE}


def test_lm_eval_passthrough_readonly_output_path_refused_before_work(tmp_path, monkeypatch, capsys):
    """An --output_path that cannot be written is refused before lm-eval loads or scores anything (lm-eval
    would run, log "Could not save results" and exit 0), as quantgate eval --output-path is."""
    import lm_eval

    def must_not_run(*args, **kwargs):
        raise AssertionError("lm-eval ran before its output path was checked")

    monkeypatch.setattr(lm_eval, "simple_evaluate", must_not_run)
    (tmp_path / "blocker").write_text("a file, not a folder")
    for out in (tmp_path / "blocker" / "x", tmp_path / "blocker" / "x" / "results.json"):
        assert main(_lm_eval_argv(Path("tiny-llama"), out, "quantgate_ppl")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("quantgate lm-eval: error: --output_path ")
        assert "cannot write there" in err
    # a read-only mount (root ignores chmod): the write probe fails

    def refuse(directory):
        raise OSError(errno.EROFS, "Read-only file system", str(directory))

    monkeypatch.setattr(files, "_probe", refuse)
    argv = _lm_eval_argv(Path("tiny-llama"), tmp_path / "ro", "quantgate_ppl")
    argv[argv.index("--output_path")] = "-o"  # lm-eval's short form
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Read-only file system" in err and "cannot write there" in err and err.count("\n") == 1
    assert not (tmp_path / "ro").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """eval.json of two different float models (a, b), of b quantized (its source: b's sha256), of b and its
    quantized model on cloze with 2 shots; each in its own folder."""
    root = tmp_path_factory.mktemp("runs")
    a, b = qg.build("tiny-llama", seed=0), qg.build("tiny-llama", seed=1)
    q = qg.quantize(b, "w8-int8")
    made = {
        "fa": qg.evaluate(a, tasks=CLOZE, limit=3).to_json(),
        "fb": qg.evaluate(b, tasks=CLOZE, limit=3).to_json(),
        "qb": qg.evaluate(q, tasks=CLOZE, limit=3).to_json(),
        "qb2": qg.evaluate(q, tasks=CLOZE, limit=3, num_fewshot=2).to_json(),
    }
    assert made["qb"]["settings"]["source_sha256"] == made["fb"]["settings"]["model_sha256"]
    assert made["fa"]["settings"]["model_sha256"] != made["fb"]["settings"]["model_sha256"]
    for name, result in made.items():
        (root / name).mkdir()
        (root / name / "eval.json").write_text(json.dumps(result))
    return root


def _row(table: str, fragment: str) -> str:
    rows = [line for line in table.splitlines() if fragment in line]
    assert len(rows) == 1, rows
    return rows[0]


def test_compare_baseline_hash_mismatch_refused(runs, capsys):
    """--baseline fa for a run quantized from b: refused, naming both hashes and --force-baseline."""
    short_a = json.loads((runs / "fa" / "eval.json").read_text())["settings"]["model_sha256"][:12]
    with pytest.raises(ValueError, match=rf"sha256 {short_a}.*--force-baseline"):
        compare([runs / "qb"], baseline=runs / "fa")
    assert main(["compare", str(runs / "qb"), "--baseline", str(runs / "fa")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force-baseline" in err
    table = compare([runs / "qb"], baseline=runs / "fb")  # its own source: accepted as before
    assert "(--baseline)" in _row(table, "| w8-int8 |")


def test_compare_force_baseline_stated(runs, capsys):
    """--force-baseline pairs them anyway, and the table says the hashes disagree."""
    table = compare([runs / "qb"], baseline=runs / "fa", force_baseline=True)
    row = _row(table, "| w8-int8 |")
    assert "--force-baseline" in row
    assert "--force-baseline" in table.split("\n\n", 1)[1] and "sha256" in table.split("\n\n", 1)[1]
    assert main(["compare", str(runs / "qb"), "--baseline", str(runs / "fa"), "--force-baseline"]) == 0
    assert "--force-baseline" in capsys.readouterr().out


def test_compare_different_fewshot_refused(runs):
    """A 2-shot quantized run is not paired with its 0-shot float source (same weights, other prompts); as
    --baseline it is refused, naming the setting."""
    table = compare([runs / "fb", runs / "qb2"])
    row = _row(table, "| w8-int8 |")
    assert "num_fewshot" in row and "(source sha256" not in row
    assert row.endswith("| - |")  # no change computed
    with pytest.raises(ValueError, match=r"num_fewshot"):
        compare([runs / "qb2"], baseline=runs / "fb")
    # the 0-shot quantized run still pairs with it
    both = compare([runs / "fb", runs / "qb"])
    assert "(source sha256" in _row(both, "| w8-int8 |")


def test_compare_shows_cloze_perplexity(runs, tmp_path):
    """quantgate_cloze reports perplexity and acc; compare shows both, for quantgate's eval.json (with the
    paired change) and for another tool's lm-eval results JSON."""
    table = compare([runs / "fb", runs / "qb"])
    head = table.splitlines()[0]
    assert f"{CLOZE}/perplexity" in head and f"{CLOZE}/acc" in head
    row = _row(table, "| w8-int8 |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    column = [c.strip() for c in head.strip("|").split("|")].index(f"{CLOZE}/perplexity delta")
    assert cells[column] not in ("-", "") and "%" in cells[column]  # the paired change of the perplexity
    results = {
        "results": {CLOZE: {"perplexity,none": 123.5, "perplexity_stderr,none": 7.0, "acc,none": 0.25, "alias": CLOZE}},
        "configs": {CLOZE: {}},
        "versions": {CLOZE: 1.0},
        "n-shot": {CLOZE: 0},
        "config": {"model": "hf", "model_args": "pretrained=someone/model"},
    }
    (tmp_path / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results))
    (record,) = collect_evals([tmp_path])
    assert record.values[f"{CLOZE}/perplexity"] == 123.5
    third = compare([tmp_path])
    assert f"{CLOZE}/perplexity" in third.splitlines()[0] and "123.5 ± 7" in third
