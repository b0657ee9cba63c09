"""Acceptance of ``quantgate audit`` on a real model: SmolLM2-135M saved by plain transformers (not the packaged
name), audited at the default 10-minute budget. Its answer agrees with the main job's SmolLM2 rows (the same
documents, settings and dtype) within their intervals, and its export (the recipe within +5%) loads in plain
``from_pretrained`` with the weights ``qg.load`` reads. Its wall time against the budget is measured by
benchmarks/audit.py, not here."""

from pathlib import Path

import pytest
import torch
from conftest import load_script

import quantgate as qg
from quantgate.study import read_metrics
from quantgate.study.measures import ppl_change

ROOT = Path(__file__).resolve().parents[1]


def plain_smollm2(folder: Path) -> Path:
    """benchmarks/audit.py's SmolLM2-135M written by plain transformers (bfloat16)."""
    return load_script(ROOT / "benchmarks" / "audit.py", "audit_benchmark").plain_smollm2(folder)


@pytest.mark.slow
def test_smollm2_saved_by_transformers_agrees_with_the_main_job(tmp_path):
    folder = plain_smollm2(tmp_path / "SmolLM2-135M")
    # at the default +1% no rung is resolved on SmolLM2 in 10 minutes (results/bench/audit-smollm2-cpu.md: weight-only
    # INT8 +0.8% [+0.2, +1.9]). At +5% SmoothQuant before per-token INT8 (+1.7% [+1.2, +2.5]) is within, further from
    # the threshold than bfloat16's tolerance (1 pp + 10% of the change; at +3% it was not), and it is exported;
    # FP8 (+4.5% [+3.9, +5.2]) and per-token INT8 (+5.4% [+4.2, +6.8]) straddle +5%
    found = qg.audit(str(folder), tmp_path / "audit", budget="10m", within="5%", progress=False)
    assert found.survives_static_int8 is False and "does not survive it" in found.answer.splitlines()[2]
    main_job = {c.model: c for c in read_metrics(ROOT / "results" / "quickstart").cells}["smollm2-135m"]
    shared = [s for s in found.changes["SmolLM2-135M"] if ppl_change(main_job, s) is not None]
    assert "w8a8-int8-static" in shared and len(shared) >= 3
    for scheme in shared:
        ours, theirs = found.changes["SmolLM2-135M"][scheme], ppl_change(main_job, scheme)
        assert theirs is not None and theirs.low is not None and theirs.high is not None
        assert theirs.low <= ours.value <= theirs.high, (scheme, ours, theirs)
    assert found.recipe == "w8a8-int8-dynamic:smooth=0.5" and found.export is not None
    from transformers import AutoModelForCausalLM

    # the export holds bfloat16 weights: plain transformers (which decompresses them at its first forward) and
    # qg.load read every quantized weight bit for bit alike (their logits differ within bfloat16's rounding: the
    # two forward paths round differently; tests/test_audit.py checks float32 logits on a tiny export)
    plain = AutoModelForCausalLM.from_pretrained(found.export).eval()
    ours_model = qg.load(found.export, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        plain(torch.randint(5, 40000, (1, 16)))
    read_plain = {n: m.weight for n, m in plain.named_modules() if n.endswith("proj")}
    read_ours = {n: m.weight for n, m in ours_model.named_modules() if n.endswith("proj")}
    assert len(read_plain) == 7 * 30 and read_plain.keys() == read_ours.keys()  # q, k, v, o, gate, up, down x 30
    for name, weight in read_plain.items():
        assert torch.equal(weight, read_ours[name]), name
