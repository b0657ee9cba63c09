"""The ecosystem scripts (scripts/ecosystem/): their --help always; the real runs (a venv each with
llm-compressor / vLLM, minutes of installing and running) only with ``-m slow``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "ecosystem"


@pytest.mark.parametrize("script", ["llmcompressor_roundtrip.py", "vllm_serve.py"])
def test_help(script):
    res = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--venv" in res.stdout and "--out" in res.stdout


def test_helpers(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import _venv
    finally:
        sys.path.remove(str(SCRIPTS))
    assert _venv.same_version("2.13.0+cpu", "2.13.0") and not _venv.same_version("2.13.1", "2.13.0")
    assert _venv.quant_method(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert _venv.quant_method(tmp_path) == "compressed-tensors"
    assert _venv.display([sys.executable, "-m", "quantgate.cli", "info", "x y"]) == "quantgate info 'x y'"


@pytest.mark.slow
def test_llmcompressor_roundtrip(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPTS / "llmcompressor_roundtrip.py"), "--limit", "2", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "llmcompressor.json").read_text())
    float_row, ct_row = data["checkpoints"]
    assert ct_row["quant_method"] == "compressed-tensors"
    assert ct_row["size_bytes"] < float_row["size_bytes"]
    assert 1 < float_row["word_perplexity"] < ct_row["word_perplexity"] * 1.5
    assert math.isfinite(ct_row["delta"]["value"])
    assert (out / "llmcompressor.md").read_text().startswith("# llm-compressor")


@pytest.mark.slow
def test_vllm_serve(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPTS / "vllm_serve.py"), "--no-exports", "--docs", "3", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "vllm.json").read_text())
    float_row = data["checkpoints"][0]
    assert float_row["vllm_accepted"]
    s = float_row["summary"]
    assert abs(s["vllm_nll"] - s["quantgate_nll"]) < 1e-2  # the same float model, two engines
    assert s["tokens_scored"] == data["tokens_scored"]
