"""Data-parallel evaluation (issue 33): two gloo processes on this CPU, each a rank of lm-eval's own split, give
every document the value the one-process run gives it, for a calibrated static scheme on a causal LM and for a
masked LM scored by pseudo-log-likelihood."""

import json
import subprocess
import sys

import pytest
from conftest import run_python

from quantgate import parallel
from quantgate.cli import main


@pytest.mark.parametrize(
    "args",
    [
        # 5 documents over 2 ranks: lm-eval pads the short rank; batches of 8 group different documents
        ["tiny-llama", "--scheme", "w8a8-int8-static", "--limit", "5"],
        pytest.param(
            ["tiny-bert", "--tasks", "quantgate_cloze", "--limit", "3", "--batch-size", "16"], marks=pytest.mark.slow
        ),  # twenty seconds: the same split for quantgate-mlm
    ],
    ids=["causal-static", "masked-pll"],
)
def test_two_processes_score_each_document_as_one_does(args, tmp_path):
    assert main(["eval", *args, "--out", str(tmp_path / "one")]) == 0
    cmd = ["-m", "quantgate.cli", "eval", *args, "--out", str(tmp_path / "two"), "--processes", "2"]
    done = run_python(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 alone reports and writes
    one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
    for task, columns in one["documents"].items():
        assert len(columns["ids"]) == int(args[args.index("--limit") + 1])
        assert two["documents"][task] == columns  # every document, every column, exactly
    assert two["results"] == one["results"] and two["settings"] == one["settings"]


def test_a_lone_process_is_no_rank_and_processes_must_be_counted(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.joined() is None and parallel.is_first() and parallel.from_first({"a": 1}) == {"a": 1}
    assert main(["eval", "tiny-llama", "--processes", "0"]) == 2
    assert "--processes must be a whole number >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"this machine has .* (GPU|CPU core)"):
        parallel.relaunch(["eval", "tiny-llama"], 10_000)


@pytest.mark.slow  # a minute or more: study runs in subprocesses or twice
def test_a_study_in_two_processes_ends_as_one_process_does(tmp_path):
    """``quantgate study --processes 2``: both ranks run every cell, each evaluation split between them, rank 0
    alone writing. metrics.json holds the one-process run's observe statistics, quantization errors and every
    document's value, float and quantized; a re-run in two processes finds every step cached. A study that trains
    is refused, as are cells on Ray (run_study checks before any work)."""
    import quantgate as qg
    from quantgate.study import read_metrics, run_study

    qg.save(qg.build("tiny-llama", seed=2), tmp_path / "base")
    study = tmp_path / "dp.yaml"
    study.write_text(
        f"name: dp\nseed: 0\nmodels:\n  - name: base\n    load: {tmp_path / 'base'}\n    variants: [vanilla]\n"
        "schemes: [w8a8-int8-static]\ncalibration: {batches: 2, seq_len: 32, batch_size: 4}\n"
        "observe: {batches: 1, seq_len: 32, batch_size: 4}\neval: {tasks: [quantgate_ppl], limit: 3}\n"
    )
    one = read_metrics(run_study(study, tmp_path / "one")).cells[0]

    def two_processes(*extra):
        cmd = [
            sys.executable,
            "-m",
            "quantgate.cli",
            "study",
            str(study),
            "--out",
            str(tmp_path / "two"),
            "--processes",
            "2",
            *extra,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("wrote ") == 1  # rank 0 alone reports
        return done, read_metrics(tmp_path / "two").cells[0]

    _, two = two_processes()
    assert two.observe == one.observe and two.float_documents == one.float_documents
    assert two.float_results == one.float_results
    assert two.schemes["w8a8-int8-static"].documents == one.schemes["w8a8-int8-static"].documents
    assert two.schemes["w8a8-int8-static"].logits_sqnr_db == one.schemes["w8a8-int8-static"].logits_sqnr_db
    steps = {f: f.stat().st_mtime_ns for f in (tmp_path / "two" / "cells").rglob("*.json")}
    _, cached = two_processes()
    assert cached.to_json() == two.to_json()
    assert {f: f.stat().st_mtime_ns for f in steps} == steps  # every step found cached: none written again

    from quantgate.study import load_study
    from quantgate.study.steps import _check_data_parallel

    trains = tmp_path / "trains.yaml"
    trains.write_text(
        study.read_text().replace("    variants: [vanilla]\n", "    variants: [vanilla]\n    train: {steps: 1}\n")
    )
    with pytest.raises(ValueError, match="splits evaluation, not training, and base train"):
        _check_data_parallel(load_study(trains), "serial")
    with pytest.raises(ValueError, match="leave out --processes, or the executor"):
        _check_data_parallel(load_study(study), "ray")
