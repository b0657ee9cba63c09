"""The gated / ungated twins shipped inside the package (experiments/twins_search.py --package)."""

import json
import re
from pathlib import Path

import pytest

import quantgate as qg
from quantgate.models import variant_of


@pytest.mark.parametrize("name, variant", [("twin-vanilla", "vanilla"), ("twin-g1", "g1-elementwise")])
def test_packaged_twins_load_offline_and_reproduce_their_search_numbers(name, variant):
    """The shipped pair loads from inside the package (no network, no extra package), carries its variant,
    and scores the held-out backcopy perplexity the twins search committed for it."""
    model = qg.load(name)
    assert str(variant_of(model)) == variant and qg.tokenizer(model).name_or_path
    card = (Path(qg.__file__).parent / "models" / "checkpoints" / name / "README.md").read_text()
    found = re.search(r"search's (\S+) pair, seed (\d+)", card)
    assert found is not None
    candidate, seed = found.groups()
    metrics = json.loads(
        (
            Path(__file__).resolve().parents[1]
            / "results"
            / "twins_search"
            / candidate
            / f"seed{seed}"
            / "metrics.json"
        ).read_text()
    )
    cell = next(c for c in metrics["cells"] if c["variant"] == variant)
    settings = metrics["study"]["models"][0]["eval"]
    got = qg.evaluate(model, tasks=["quantgate_backcopy"], limit=settings["limit"]["quantgate_backcopy"])
    assert got.results["quantgate_backcopy"]["perplexity"] == pytest.approx(
        cell["float"]["quantgate_backcopy"]["perplexity"], rel=1e-5
    )
