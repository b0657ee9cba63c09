"""experiments/gpu_twins.py, the device's twin experiment: its CPU dry run end to end (so the one GPU run cannot
rot), its lm-eval-free perplexity against qg.evaluate's quantgate_ppl, and its refusal to train the full
configuration on a machine without CUDA."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import quantgate as qg
from quantgate import stats

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_twins.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_twins", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gt = _script()


ABSENT_ON_DEVICE = ("lm_eval", "datasets", "torchao", "bitsandbytes")  # the H200 image has none of them


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_twins")
    with pytest.MonkeyPatch.context() as mp:
        for name in ABSENT_ON_DEVICE:  # a None entry makes `import name` fail, as it would there
            mp.setitem(sys.modules, name, None)
        rc = gt.main(["--dry-run", "--out", str(out)])
    return rc, out, json.loads((out / "metrics.json").read_text())


def test_dry_run_trains_and_observes_both_twins(dry_run):
    rc, _, rec = dry_run
    assert rc == 0
    assert rec["dry_run"] and rec["device"]["name"]
    steps = rec["config"]["steps"]
    assert rec["config"]["min_steps"] <= steps <= rec["config"]["max_steps"]  # --steps auto, clamped
    assert rec["probe"]["step_s"] > 0 and rec["probe"]["steps"] == rec["config"]["probe_steps"]
    assert rec["parameters"]["g1-elementwise"] > rec["parameters"]["vanilla"]  # the gate's own parameters
    for variant in gt.VARIANTS:
        m = rec["models"][variant]
        tr = m["train"]
        assert tr["steps"] == steps and [s for s, _ in tr["loss"]] == list(range(1, steps + 1))
        assert all(math.isfinite(x) for _, x in tr["loss"]) and tr["loss_last"] < tr["loss_first"]
        assert tr["eval_loss"] and math.isfinite(tr["eval_loss"][-1][1])
        layers = m["observe"]["layers"]
        assert len(layers) == 2  # tiny-llama's blocks
        assert all(
            L["max_abs"] > 0 and L["max_median_ratio"] > 1 and 0 <= L["first_token_attention"] <= 1 for L in layers
        )
        assert m["observe"]["summary"]["max_activation"] == max(L["max_abs"] for L in layers)
        assert (m["observe"]["summary"]["gate_mean"] is None) == (variant == "vanilla")
        assert set(m["eval"]) == {"float", *gt.SCHEMES}
        assert all(e["documents"]["ids"] == rec["documents"]["ids"] for e in m["eval"].values())
    # the twins: same data, steps and seed, so the same first batch and the same untrained loss to a rounding
    first = [rec["models"][v]["train"]["loss_first"] for v in gt.VARIANTS]
    assert abs(first[0] - first[1]) < 0.05


def test_report_and_metrics_are_written(dry_run):
    _, out, rec = dry_run
    assert {
        "config",
        "device",
        "timings",
        "parameters",
        "probe",
        "documents",
        "models",
        "changes",
        "differences",
    } <= set(rec)
    assert (
        len(rec["documents"]["ids"]) == 2
        and rec["documents"]["tokens"] == (rec["models"]["vanilla"]["eval"]["float"]["documents"]["tokens"])
    )
    assert rec["timings"]["total_s"] > 0 and all(f"train_{v}_s" in rec["timings"] for v in gt.VARIANTS)
    text = (out / "report.md").read_text()
    for needed in (
        "# GPU twins",
        "Dry run",
        "Device: no GPU (CPU)",
        "## Training",
        "## Outliers and sinks",
        "## Quantization",
        "## Reading",
        "## Timings",
        "![layers.png](layers.png)",
        *gt.SCHEMES,
    ):
        assert needed in text, needed
    assert (out / "layers.png").stat().st_size > 10_000
    # what a device run returns: at most 8 files in all (gpu_check writes two), plain names
    assert sorted(p.name for p in out.rglob("*")) == ["layers.png", "metrics.json", "report.md"]


def test_every_change_has_an_interval_or_says_why(dry_run):
    _, _, rec = dry_run
    found = [rec["changes"][v][s] for v in gt.VARIANTS for s in gt.SCHEMES] + list(rec["differences"].values())
    found.append(rec["changes"]["gated_vs_ungated_float"])
    assert len(found) == 10
    for d in found:
        assert d["method"]
        if d["low"] is None or d["high"] is None:
            assert d["method"].startswith("no "), d
        else:
            assert d["low"] <= d["value"] <= d["high"], d
            assert "[n/a]" not in d["text"]


def test_paired_difference_is_the_difference_of_the_changes(dry_run):
    _, _, rec = dry_run
    docs = {v: {s: e["documents"] for s, e in rec["models"][v]["eval"].items()} for v in gt.VARIANTS}
    for scheme in gt.SCHEMES:
        per = {v: stats.paired_delta(docs[v]["float"], docs[v][scheme], "perplexity").value for v in gt.VARIANTS}
        assert [rec["changes"][v][scheme]["value"] for v in gt.VARIANTS] == pytest.approx(list(per.values()), 1e-12)
        d = rec["differences"][scheme]
        assert d["value"] == pytest.approx(per["g1-elementwise"] - per["vanilla"], rel=1e-9, abs=1e-12)
        assert d["difference_of_changes"] == pytest.approx(d["value"], rel=1e-9, abs=1e-12)
        pairs = [(docs[v]["float"], docs[v][scheme]) for v in gt.VARIANTS]
        fallback = gt.jackknife_difference(*pairs)  # the script's own interval, where stats has none
        assert fallback.value == pytest.approx(d["value"], rel=1e-9, abs=1e-12)
        assert fallback.low <= fallback.value <= fallback.high
        if hasattr(stats, "paired_difference"):
            base, other = pairs
            theirs = stats.paired_difference(base, other, "perplexity")
            if theirs.method.startswith("jackknife t-interval") and "log" not in theirs.method:
                assert (fallback.low, fallback.high) == pytest.approx((theirs.low, theirs.high), rel=1e-9)


def test_jackknife_difference_on_known_values():
    """Two models, three documents: the difference of the ratio-of-sums changes and its leave-one-out spread."""

    def docs(ll):
        return {"ids": [0, 1, 2], "loglikelihood": ll, "tokens": [10, 20, 30]}

    base = (docs([-10.0, -20.0, -30.0]), docs([-11.0, -21.0, -33.0]))
    other = (docs([-10.0, -20.0, -30.0]), docs([-10.5, -20.0, -31.0]))
    d = gt.jackknife_difference(base, other)
    assert d.value == pytest.approx(math.expm1(1.5 / 60) - math.expm1(5 / 60))
    loo = [math.expm1(o) - math.expm1(b) for o, b in ((1.0 / 50, 4 / 50), (1.5 / 40, 4 / 40), (0.5 / 30, 2 / 30))]
    se = math.sqrt(2 / 3 * sum((x - np.mean(loo)) ** 2 for x in loo))
    assert d.high - d.value == pytest.approx(4.302653 * se, rel=1e-5)  # t(0.975, 2 df)
    one = gt.jackknife_difference(*(tuple({k: v[:1] for k, v in x.items()} for x in pair) for pair in (base, other)))
    assert one.low is None and one.method.startswith("no interval")


def test_direct_perplexity_is_quantgate_ppl():
    """The device has no lm-eval: the script's own rolling-window scoring gives qg.evaluate's quantgate_ppl
    documents (lm-eval's loglikelihood_rolling), column for column."""
    pytest.importorskip("lm_eval")
    from lm_eval import utils

    for n, length in ((1, 4), (4, 4), (5, 4), (9, 4), (177, 32), (5148, 32), (31, 32)):
        tokens = list(range(100, 100 + n))
        mine = gt.rolling_windows(n, length)
        full = [1, *tokens]
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(tokens, 1, length, 1)]
        assert [full[s + w - k + 1 : s + w + 1] for s, w, k in mine] == [cont for _, cont in theirs]  # scored
        assert [full[s : s + w] for s, w, _ in mine] == [(ctx + cont)[:-1] for ctx, cont in theirs]
    model = qg.build("tiny-llama", "g1-elementwise", seed=0)
    tok = qg.tokenizer(model)
    mine = gt.ppl_documents(model, tok, gt.held_out_documents(qg, 1), 32, 4)  # 177 tokens: 6 windows
    evaluated = qg.evaluate(model, tok, ["quantgate_ppl"], limit=1, batch_size=16, max_length=32)
    ref = evaluated.documents["quantgate_ppl"].to_json()  # as eval.json holds it
    for column in ("ids", "tokens", "words", "bytes", "works"):
        assert mine[column] == ref[column], column
    assert mine["loglikelihood"] == pytest.approx(ref["loglikelihood"], rel=1e-5)


def test_auto_steps_fill_the_budget():
    cfg = dict(gt.FULL, budget_s=270.0)
    measured = {"step_s": 0.05, "overhead_s": 10.0}
    steps = gt.auto_steps(cfg, measured, elapsed=40.0)
    assert steps == int(((270 - 40 - gt.RESERVE_S) / 2 - 10) / (0.05 * 1.05))
    assert gt.auto_steps(cfg, measured, elapsed=400.0) == gt.MIN_STEPS  # over budget: the floor, not zero
    assert gt.auto_steps(dict(gt.DRY, budget_s=60.0), measured, elapsed=1.0) == gt.DRY["max_steps"]


def test_refuses_the_full_run_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA here even on a GPU machine
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_twins: no CUDA device") and "--dry-run" in lines[0]
    assert not (tmp_path / "out").exists() and time.perf_counter() - t0 < 60  # refused before any work


@pytest.mark.parametrize(
    "ratio, low, passed",
    [(800.0, 0.15, True), (499.0, 0.15, False), (800.0, 0.09, False), (None, None, False)],
)
def test_the_manipulation_check_gives_no_test_unless_the_ungated_twin_breaks(ratio, low, passed):
    """Declared before any run: max / median >= 500 and a static W8A8 interval at or above +10%, else every
    scheme reads "no test" (not "no gate effect"); by hand on made-up records."""
    change = {"value": 0.2 if low is not None else None, "low": low, "high": 0.3, "text": "+20% [..]"}
    rec = {
        "models": {"vanilla": {"observe": {"summary": {"max_median_ratio": ratio}}}},
        "changes": {"vanilla": {"w8a8-int8-static": change}},
    }
    check = gt.manipulation_check(rec)
    assert check["passed"] is passed
    assert check["text"].startswith("passed" if passed else "failed, so no test of the gate")


def test_the_dry_run_reads_no_test_where_the_check_fails(dry_run):
    """The tiny dry-run twins never grow outliers: the report says so and draws no gate verdict."""
    _, out, rec = dry_run
    assert rec["manipulation_check"]["passed"] is False
    text = (out / "report.md").read_text()
    reading = next(line for line in text.splitlines() if "Manipulation check (declared before the run)" in line)
    assert "Manipulation check (declared before the run): failed, so no test of the gate" in reading
    assert "no test (the manipulation check failed)" in reading
    assert "no difference beyond noise" not in reading and "the gate loses" not in reading
