"""Data-parallel evaluation (issue 33): two gloo processes on this CPU, each a rank of lm-eval's own split, give
every document the value the one-process run gives it, for a calibrated static scheme on a causal LM and for a
masked LM scored by pseudo-log-likelihood."""

import json
import subprocess
import sys

import pytest

from quantgate import parallel
from quantgate.cli import main


@pytest.mark.parametrize(
    "args",
    [
        # 5 documents over 2 ranks: lm-eval pads the short rank; batches of 8 group different documents
        ["tiny-llama", "--scheme", "w8a8-int8-static", "--limit", "5"],
        pytest.param(["tiny-bert", "--tasks", "quantgate_cloze", "--limit", "3", "--batch-size", "16"],
                     marks=pytest.mark.slow),  # twenty seconds: the same split for quantgate-mlm
    ],
    ids=["causal-static", "masked-pll"],
)
def test_two_processes_score_each_document_as_one_does(args, tmp_path):
    assert main(["eval", *args, "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "quantgate.cli", "eval", *args, "--out", str(tmp_path / "two"), "--processes", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
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
    with pytest.raises(ValueError, match="this machine has .* (GPU|CPU core)"):
        parallel.relaunch(["eval", "tiny-llama"], 10_000)
