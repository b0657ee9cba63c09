"""Each study step's output format has a version (its ``format`` in quantgate.study.steps.STEPS). A tiny study's
step files are reduced to their shape (keys and value kinds, lists by their first item) and held to
tests/step_formats.json: a step whose output changes shape under the same version fails here, naming the step and
what to bump; a resumed study recomputes, and names, steps that other code computed.

    python tests/test_step_formats.py     # after bumping a version: write the shapes this code makes
"""

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantgate.models.cost import GateCost
from quantgate.registry import Registry
from quantgate.study import load_study, run_study, steps

SHAPES = Path(__file__).with_name("step_formats.json")
STUDY = (
    "name: formats\nseed: 0\nmodels:\n  - name: tiny\n    preset: tiny-llama\n    variants: [g1-headwise]\n"
    "    train: {steps: 2, batch_size: 2, seq_len: 16, lr: 0.001, eval_batches: 1, observe_every: 1}\n"
    "schemes: [w8a8-int8-static]\ncalibration: {batches: 1, seq_len: 16, batch_size: 2}\n"
    "observe: {batches: 1, seq_len: 16, batch_size: 2}\neval: {tasks: [quantgate_ppl], limit: 1}\n"
)
VOLATILE = ("key", "seconds", "format")  # what every step file carries besides its output


def shape(value):
    """The structure of a JSON value: objects by their keys, lists by their first item, scalars by kind."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return "bool" if isinstance(value, bool) else "null"
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def formats() -> dict[str, int]:
    """Each step's format now."""
    return {name: step.format for name, step in steps.STEPS.items()}


def shapes(run: Path) -> dict:
    """Each step's output shape in the run's (one) cell."""
    (cell,) = load_study(json.loads((run / "metrics.json").read_text())["study"]["file"]).cells()
    cdir = next(run.glob("cells/*"))
    found = {}
    for step, name, _ in steps._CellRun(cell, cdir).planned():
        data = json.loads((cdir / f"{name}.json").read_text())
        found[step.name] = shape({k: v for k, v in data.items() if k not in VOLATILE})
    return found


def problems(found: dict, recorded: dict, formats: dict) -> list[str]:
    """What disagrees between the shapes this code makes and the recorded ones, as instructions."""
    out = []
    for kind, version in formats.items():
        was = recorded.get(kind, {})
        if was.get("format") != version:
            out.append(
                f"{kind}: STEPS says format {version}, {SHAPES.name} holds format {was.get('format')}: "
                f"run python tests/test_step_formats.py to record the shape of format {version}"
            )
        elif was.get("shape") != found.get(kind):
            out.append(
                f"{kind}: its output changed shape under format {version}: raise STEPS['{kind}'].format "
                f"(cached results of the old code are then computed again), then run python "
                f"tests/test_step_formats.py"
            )
    return out


def _run(tmp: Path, name: str = "run") -> Path:
    study = tmp / "formats.yaml"
    study.write_text(STUDY)
    return run_study(study, tmp / name)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("formats"))


def test_every_step_keeps_the_shape_its_format_records(run):
    found = shapes(run)
    assert set(found) == set(steps.STEPS)
    assert problems(found, json.loads(SHAPES.read_text()), formats()) == []


def test_a_changed_output_under_the_same_format_fails(tmp_path, monkeypatch):
    """A step that gains a field without a new format number is named, with the bump to make."""

    @dataclass(frozen=True)
    class CostWithBytes(GateCost):  # a new metric: one field
        gate_bytes: int = 0

    cost = steps.gate_cost
    monkeypatch.setattr(steps, "gate_cost", lambda model: CostWithBytes(**dataclasses.asdict(cost(model))))
    found = shapes(_run(tmp_path))
    assert problems(found, json.loads(SHAPES.read_text()), formats()) == [
        "cost: its output changed shape under format 1: raise STEPS['cost'].format (cached results of the old code "
        "are then computed again), then run python tests/test_step_formats.py"
    ]
    bumped = {**formats(), "cost": 2}
    assert problems(found, json.loads(SHAPES.read_text()), bumped)[0].startswith("cost: STEPS says format 2")


def test_a_resumed_study_recomputes_and_names_steps_other_code_made(run, tmp_path, monkeypatch, caplog):
    import shutil

    again = tmp_path / "run"
    shutil.copytree(run, again)
    before = {f.name: f.stat().st_mtime_ns for f in again.glob("cells/*/*.json")}
    raised = dataclasses.replace(steps.STEPS["cost"], format=2)
    monkeypatch.setattr(steps, "STEPS", Registry("study step", {**steps.STEPS, "cost": raised}))
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        _run(tmp_path)
    after = {f.name: f.stat().st_mtime_ns for f in again.glob("cells/*/*.json")}
    assert {name for name in before if after[name] != before[name]} == {"cost.json"}  # nothing else ran again
    assert "cost.json was computed by other code (step format 1, now 2): computing it again" in caplog.text
    assert json.loads(next(again.glob("cells/*/cost.json")).read_text())["format"] == 2


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        made = shapes(_run(Path(tmp)))
    SHAPES.write_text(
        json.dumps({k: {"format": formats()[k], "shape": made[k]} for k in sorted(made)}, indent=1) + "\n"
    )
    print(f"wrote {SHAPES}", file=sys.stderr)
