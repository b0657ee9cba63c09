"""Acceptance of ``quantgate audit`` on a real model: SmolLM2-135M saved by plain transformers in bfloat16 (not the
packaged name), audited at the default 10-minute budget and +1%. Static INT8 does not survive; the recipe is
certified on held-out works (its float32 interval wholly below +1%), and its export loads in plain
``from_pretrained`` with the weights ``qg.load`` reads. Its wall time against the budget is measured by
benchmarks/audit.py, not here."""

from pathlib import Path

import pytest
import torch
from conftest import load_script

import quantgate as qg

ROOT = Path(__file__).resolve().parents[1]


def plain_smollm2(folder: Path) -> Path:
    """benchmarks/audit.py's SmolLM2-135M written by plain transformers (bfloat16)."""
    return load_script(ROOT / "benchmarks" / "audit.py", "audit_benchmark").plain_smollm2(folder)


@pytest.mark.slow
def test_smollm2_saved_by_transformers_gets_a_certified_recipe(tmp_path):
    folder = plain_smollm2(tmp_path / "SmolLM2-135M")
    found = qg.audit(str(folder), tmp_path / "audit", budget="10m", within="1%", progress=False)
    assert found.survives_static_int8 is False and "does not survive it" in found.answer.splitlines()[2]
    assert found.recipe is not None and found.export is not None
    by = {c.scheme: c for c in found.record.candidates}
    held = by[found.recipe].held_out
    assert by[found.recipe].certified and held is not None and held.high is not None and held.high < 0.01
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(found.export).eval()
    ours_model = qg.load(found.export, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        plain(torch.randint(5, 40000, (1, 16)))  # plain transformers decompresses its weights at the first forward
    read_plain = {n: m.weight for n, m in plain.named_modules() if n.endswith("proj")}
    read_ours = {n: m.weight for n, m in ours_model.named_modules() if n.endswith("proj")}
    assert read_plain.keys() == read_ours.keys()
    for name, weight in read_plain.items():
        assert torch.equal(weight, read_ours[name]), name
