"""benchmarks/gpu_check.py end to end on the Triton interpreter, so the GPU machine's one command cannot rot."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import run_python

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 8 s: the whole device script, dry
def test_gpu_check_dry_run(tmp_path):
    run = run_python(
        [str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rec = json.loads((tmp_path / "gpu_check-cpu-dry-run.json").read_text())
    assert rec["status"] == {
        "versions": "PASS",
        "tests": "SKIP",
        "kernel": "PASS",
        "training": "PASS",
        "benchmark": "PASS",
        "sharded": "PASS",
        "ray_study": "SKIP",
        "fsdp": "SKIP",
        "quant_speed": "PASS",
    }
    assert rec["sharded"]["max_logit_diff"] == 0.0  # a block on disk, read back: the same numbers
    assert len(rec["kernel"]) == 4 and all(e["fwd"] < 1e-5 and e["bwd"] < 1e-5 for e in rec["kernel"].values())
    assert rec["training"]["max_diff"] < 1e-4 and len(rec["training"]["triton"]) == 2
    assert "(d) fused triton" in (tmp_path / "gated_sdpa-cpu-dry-run.md").read_text()
    assert set(rec["quant_speed"]["ratios"]) == {
        "observe / forward",
        *(
            f"{s} / float"
            for s in ("w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "w4a4-mxfp4", "w4a4-nvfp4")
        ),
    }
    assert "== summary" in run.stdout and "kernel     PASS" in run.stdout


def test_a_failing_section_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def stub(name, outcome):
        def section(args, rec):
            """A stand-in."""
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        section.__name__ = name
        monkeypatch.setattr(gpu_check, name, section)

    stub("tests", RuntimeError("boom"))
    stub("kernel", ImportError("needs triton>=9"))
    stub("training", False)
    stub("benchmark", True)
    stub("sharded", True)
    stub("ray_study", True)
    stub("fsdp", True)
    stub("quant_speed", True)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--out", str(tmp_path)])
    assert gpu_check.main() == 1
    rec = json.loads((tmp_path / "gpu_check-cpu-dry-run.json").read_text())
    assert rec["status"] == {
        "versions": "PASS",
        "tests": "FAIL",
        "kernel": "SKIP",
        "training": "FAIL",
        "benchmark": "PASS",
        "sharded": "PASS",
        "ray_study": "PASS",
        "fsdp": "PASS",
        "quant_speed": "PASS",
    }
    out = capsys.readouterr()
    assert "skipped: needs triton>=9" in out.out and "RuntimeError: boom" in out.err
