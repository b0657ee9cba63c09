"""experiments/README.md: its headlines are what scripts/headlines.py generates from the committed results."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def headlines():
    spec = importlib.util.spec_from_file_location("headlines", ROOT / "scripts" / "headlines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_headlines_are_generated(headlines):
    text = headlines.README.read_text()
    assert headlines.render(text) == text, "experiments/README.md is stale: run python scripts/headlines.py"


def test_check_fails_on_a_hand_edited_number(headlines, tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    text = headlines.README.read_text()
    block = _block("quickstart")
    edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), block, count=1)  # one digit off
    readme.write_text(text.replace(block, edited))
    monkeypatch.setattr(headlines, "README", readme)
    monkeypatch.setattr("sys.argv", ["headlines.py", "--check"])
    with pytest.raises(SystemExit) as stop:
        headlines.main()
    assert stop.value.code  # a message, i.e. exit status 1


def test_hyga_static_changes_by_hand():
    """The span of the HyGA ablation's static W8A8 changes, from the committed perplexities (the README once
    said all were under 0.2% while one was +0.24%)."""
    cells = json.loads((ROOT / "results" / "hyga_ablation" / "metrics.json").read_text())["cells"]
    changes = []
    for cell in cells:
        fp = cell["float"]["quantgate_ppl"]["word_perplexity"]
        static = cell["schemes"]["w8a8-int8-static"]["results"]["quantgate_ppl"]["word_perplexity"]
        changes.append(100 * (static / fp - 1))
    assert len(changes) == 12
    span = f"static W8A8 (Linear inputs) changes {min(changes):+.2f}% to {max(changes):+.2f}%"
    assert span in _block("hyga_ablation")


def _block(name: str) -> str:
    return re.search(rf"<!-- headlines:{name} -->(.*?)<!-- /headlines -->",
                     (ROOT / "experiments" / "README.md").read_text()).group(1)


def test_headline_changes_carry_their_intervals():
    """The quickstart's SmolLM2 change with its paired interval over documents; cpu_recipe's change averaged
    over three seeds (geometric mean of the perplexity ratios) with a t-interval across them, by hand."""
    from quantgate.report import ppl_change
    from quantgate.stats import format_delta

    smol = next(c for c in json.loads((ROOT / "results" / "quickstart" / "metrics.json").read_text())["cells"]
                if c["id"] == "smollm2-135m/vanilla")
    static = ppl_change(smol, "w8a8-int8-static")
    assert static.low is not None and f"({format_delta(static, noise=', within noise')})" in _block("quickstart")
    cells = json.loads((ROOT / "results" / "cpu_recipe" / "metrics.json").read_text())["cells"]
    logs = []
    for c in cells:
        if c["variant"] == "vanilla":
            fp = c["float"]["quantgate_backcopy"]["perplexity"]
            q = c["schemes"]["w8a8-int8-bondarenko"]["results"]["quantgate_backcopy"]["perplexity"]
            logs.append(math.log(q / fp))
    mean = sum(logs) / 3  # geometric mean of the ratios: the t-interval is on their logarithms
    half = 4.302652729911275 * (sum((x - mean) ** 2 for x in logs) / 2) ** 0.5 / 3 ** 0.5  # t(0.975, 2 dof)
    pct = [100 * math.expm1(v) for v in (mean, mean - half, mean + half)]
    noise = ", within noise" if pct[1] <= 0 <= pct[2] else ""
    d = 2 if max(abs(pct[1]), abs(pct[2])) < 1 else 1  # format_delta's decimals
    recipe = _block("cpu_recipe")
    assert f"mean {pct[0]:+.{d}f}% [{pct[1]:+.{d}f}, {pct[2]:+.{d}f}]{noise}) ungated" in recipe
    assert "t-intervals across 3 seeds" in recipe


def test_headline_maxima_come_with_their_max_over_median():
    assert re.search(r"max activations [\d.]+-[\d.]+, max/median [\d.]+-[\d.]+;", _block("cpu_recipe"))
    assert re.search(r"max [\d.]+-[\d.]+, max/median [\d.]+-[\d.]+\)", _block("qiu_table4"))
    assert "HyGA 14.9 -> 7.79 -> 4.87, max/median 6.9 -> 7 -> 6.2 (GQA)" in _block("hyga_ablation")
