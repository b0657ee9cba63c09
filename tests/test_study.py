"""Studies: the grid runs end to end, caches by key, resumes after a kill, reports reproducibly,
and rejects bad study files before any work."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantgate.observe_records import CellObserve, CellSummary, LayerRow
from quantgate.provenance import machine
from quantgate.stats import fmt, pearson, spearman
from quantgate.study import CellRecord, StudyError, StudyRecord, load_study, run_study
from quantgate.study.measures import peak_activation
from quantgate.study.records import WallSeconds
from quantgate.study.report import study_markdown, write_study_report

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "smoke"
    run_study(SMOKE, out)
    return out


def _numbers(run: Path) -> dict:
    """Every number a study produced, cell by cell (timings aside)."""
    metrics = json.loads((run / "metrics.json").read_text())
    return {
        c["id"]: {
            "float": c["float"],
            "observe": c["observe"],
            "schemes": {
                s: {k: v for k, v in r.items() if k not in ("seconds", "quantize_s")} for s, r in c["schemes"].items()
            },
            "trained": c["trained"],
        }
        for c in metrics["cells"]
    }


def test_study_produces_metrics_report_and_plots(smoke_run):
    metrics = json.loads((smoke_run / "metrics.json").read_text())
    assert [c["id"] for c in metrics["cells"]] == ["tiny/vanilla", "tiny/g1-headwise"]
    assert metrics["schemes"] == ["w8a8-int8-static", "w8a8-int8-dynamic"]
    report = (smoke_run / "report.md").read_text()
    for section in (
        "Bondarenko et al.'s table",
        "Qiu et al.'s table",
        "Correlations",
        "Where quantization hurts",
        "## Training",
        "the numbers test the pipeline",
    ):
        assert section in report
    for png in ("study_layers.png", "study_quant.png", "study_training.png"):
        assert (smoke_run / png).stat().st_size > 0
    gated = metrics["cells"][1]
    assert gated["observe"]["summary"]["gate_mean"] is not None and gated["trained"]["steps"] == 12
    # every number in the tables comes from metrics.json
    fp = gated["float"]["quantgate_ppl"]["word_perplexity"]
    static = gated["schemes"]["w8a8-int8-static"]["results"]["quantgate_ppl"]["word_perplexity"]
    tokens = gated["trained"]["tokens"]
    assert f"| tiny | g1-headwise | 0 | {tokens:,} | {fp:.4g} |" in report and f"{static:.4g}" in report
    cost = gated["cost"]
    assert f"| {cost['gate_params']:,} | {cost['gate_flops_per_token']:.4g} |" in report
    assert (smoke_run / "config.yaml").is_file()


def test_report_rebuilds_byte_for_byte(smoke_run):
    before = (smoke_run / "report.md").read_bytes()
    write_study_report(smoke_run)
    assert (smoke_run / "report.md").read_bytes() == before


def test_rerun_skips_finished_steps_and_changes_rerun_only_dependents(smoke_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(smoke_run, run)
    steps = {p: p.stat().st_mtime_ns for p in run.glob("cells/*/*.json")}
    t0 = time.perf_counter()
    run_study(SMOKE, run)
    assert {p: p.stat().st_mtime_ns for p in run.glob("cells/*/*.json")} == steps  # nothing recomputed
    assert time.perf_counter() - t0 < 60
    changed = tmp_path / "smoke.yaml"
    changed.write_text(SMOKE.read_text().replace("quantgate_nextsent: 8", "quantgate_nextsent: 6"))
    run_study(changed, run)
    after = {p: p.stat().st_mtime_ns for p in run.glob("cells/*/*.json")}
    redone = {p.name for p in after if after[p] != steps[p]}
    assert redone == {"eval-float.json", "scheme-w8a8-int8-static.json", "scheme-w8a8-int8-dynamic.json"}
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["cells"][0]["float"]["quantgate_nextsent"]["sample_len"] == 6


@pytest.mark.slow  # 18 s: a study killed mid-run, then finished
def test_a_killed_study_finishes_with_the_same_numbers(smoke_run, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "quantgate.cli", "study", str(SMOKE), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    while not (out / "cells" / "tiny--vanilla" / "observe.json").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # mid-way: the first cell is half done
    proc.wait()
    assert not (out / "metrics.json").exists()
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "cells" / "tiny--vanilla").glob("*.json")}
    run_study(SMOKE, out)
    for name, mtime in done_before.items():  # finished steps were not redone
        assert (out / "cells" / "tiny--vanilla" / name).stat().st_mtime_ns == mtime
    assert _numbers(out) == _numbers(smoke_run)


def test_bad_study_files_are_rejected_before_any_work(tmp_path):
    def bad(text, fragment):
        f = tmp_path / "bad.yaml"
        f.write_text(text)
        with pytest.raises(StudyError) as err:
            run_study(f, tmp_path / "never")
        assert fragment in str(err.value), str(err.value)
        assert not (tmp_path / "never").exists()

    base = "name: x\nmodels:\n  - preset: tiny-llama\n"
    bad(base + "schemes: [w8a8-int8-static]\nevall: {}\n", "bad.yaml:5: unknown key 'evall'; valid: calibration,")
    bad("name: x\nmodels:\n  - preset: tiny-lama\n", "bad.yaml:3: unknown preset 'tiny-lama'; valid: tiny-bert")
    bad(base + "variants: [vanilla, g1-magic]\n", "bad.yaml:4: unknown attention variant 'g1-magic'; valid: vanilla")
    bad(base + "schemes:\n  - w8a8-int8-static\n  - w9\n", "bad.yaml:6: unknown quantization scheme 'w9'")
    bad(
        base + "eval:\n  tasks: [quantgate_pppl]\n",
        "unknown task 'quantgate_pppl'; bundled: quantgate_passages, quantgate_ppl",
    )
    bad(base + "    train: {stepz: 3}\n", "bad.yaml:4: unknown key 'stepz'; valid:")
    bad("name: x\nmodels:\n  - preset: tiny-llama\n    load: smollm2-135m\n", "exactly one of 'preset'")
    bad("name: x\nmodels: []\n", "non-empty 'models' list")
    bad("name: [x\n", "not valid YAML")
    with pytest.raises(StudyError, match="no study file"):
        load_study(tmp_path / "missing.yaml")


def test_correlations_against_hand_computation():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 4.1, 5.9, 8.2]
    mx, my = sum(x) / 4, sum(y) / 4
    hand = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / math.sqrt(
        sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)
    )
    assert pearson(x, y) == pytest.approx(hand)
    assert spearman([1, 5, 2, 8], [10, 30, 20, 25]) == pytest.approx(0.8)  # ranks 1,3,2,4 vs 1,4,2,3
    assert spearman([1, 1, 2], [3, 4, 5]) == pytest.approx(0.8660254)  # ties take average ranks
    assert pearson([1, 2], [3, 4]) is None and pearson([1, 1, 1], [1, 2, 3]) is None


def test_cells_keep_per_document_values_and_the_report_shows_their_intervals(smoke_run):
    from quantgate.stats import format_delta, paired_delta

    metrics = json.loads((smoke_run / "metrics.json").read_text())
    cell = metrics["cells"][1]
    fp, static = cell["float_documents"], cell["schemes"]["w8a8-int8-static"]["documents"]
    assert len(fp["quantgate_nextsent"]["ids"]) == 8 and len(fp["quantgate_ppl"]["ids"]) == 1
    acc = paired_delta(fp["quantgate_nextsent"], static["quantgate_nextsent"], "acc")
    assert acc.low is not None
    report = (smoke_run / "report.md").read_text()
    fp_acc = cell["float"]["quantgate_nextsent"]["acc"]
    q_acc = cell["schemes"]["w8a8-int8-static"]["results"]["quantgate_nextsent"]["acc"]
    assert f"| quantgate_nextsent | {fp_acc:.4g} | {q_acc:.4g} | {format_delta(acc)} |" in report
    ppl = cell["schemes"]["w8a8-int8-static"]["results"]["quantgate_ppl"]["word_perplexity"]
    one = paired_delta(fp["quantgate_ppl"], static["quantgate_ppl"], "word_perplexity")
    assert one.low is None and f"| {ppl:.4g} | {format_delta(one)}" in report  # one perplexity document: no interval
    # with more documents, the perplexity change of the table carries its paired interval
    words = [100, 200, 300]
    cell["float_documents"]["quantgate_ppl"] = {
        "ids": [0, 1, 2],
        "loglikelihood": [-3.0 * w for w in words],
        "words": words,
    }
    for scheme, loss in (("w8a8-int8-static", 3.1), ("w8a8-int8-dynamic", 3.0)):
        cell["schemes"][scheme]["documents"]["quantgate_ppl"] = {
            "ids": [0, 1, 2],
            "loglikelihood": [-loss * w for w in words],
            "words": words,
        }
    report = _report(metrics)
    assert "| +10.5% [+10.5, +10.5] approximate |" in report  # every leave-one-out the same; 3 documents: approximate
    assert "| +0.00% [+0.00, +0.00] ~ approximate |" in report
    del cell["schemes"]["w8a8-int8-dynamic"]["documents"]["quantgate_ppl"]["ids"][-1]
    with pytest.raises(ValueError, match="cover different documents"):  # a mismatched set is refused, not averaged
        _report(metrics)


def _report(metrics: dict) -> str:
    """The report of a metrics.json's data (the report reads it typed)."""
    return study_markdown(StudyRecord.from_json(metrics))


def _without_documents(metrics: dict) -> dict:
    """A committed run as it would be without per-document values (the runs made before they were kept)."""
    cells = [
        {
            **{k: v for k, v in c.items() if k != "float_documents"},
            "schemes": {s: {k: v for k, v in r.items() if k != "documents"} for s, r in c["schemes"].items()},
        }
        for c in metrics["cells"]
    ]
    return {**metrics, "cells": cells}


def _committed(name: str) -> dict:
    return json.loads((ROOT / "results" / name / "metrics.json").read_text())


def test_committed_reports_carry_intervals_and_say_when_there_are_none():
    """Committed runs: every change has its paired interval; stripped of their per-document values they say
    [n/a]; correlations only from n = 5; max / median of the block holding the max; kurtosis's tensors named."""
    quickstart = _committed("quickstart")
    with_docs, without = _report(quickstart), _report(_without_documents(quickstart))
    assert re.search(r"\| [+-]\d+\.\d+% \[[+-]\d", with_docs)  # a change with its interval
    assert not re.search(r"\d(%|x| pp) \[n/a\]", with_docs)  # no change without its interval
    rows = "\n".join(line for line in without.splitlines() if line.startswith("|"))  # the tables, not the notes
    assert not re.search(r"% \[[+-]\d", rows) and "[n/a]: no interval" in without
    assert "None: fewer than 5 cells have any two of the numbers." in without and "(n=4)" not in without
    for cell in quickstart["cells"]:  # the ratio is that of the block holding the largest activation
        peak, ratio = peak_activation(CellRecord.from_json(cell))
        assert f"| {fmt(peak)} | {fmt(ratio)} |" in with_docs
    assert "then over Bondarenko et al.'s tensors (their reference code): for BERT each layer's FFN output" in with_docs
    assert "(n=8)" in _report(_committed("qiu_table4"))


def test_seeds_average_with_a_t_interval_when_cells_lack_documents():
    recipe = _without_documents(_committed("cpu_recipe"))
    vanilla = [c for c in recipe["cells"] if c["variant"] == "vanilla"]
    changes = [100 * _change(c, "w8a8-int8-bondarenko") for c in vanilla]  # the report's first scheme
    mean = sum(changes) / 3
    half = 4.302652729911275 * math.sqrt(sum((x - mean) ** 2 for x in changes) / 2) / math.sqrt(3)
    d = 2 if max(abs(mean - half), abs(mean + half)) < 1 else 1  # format_delta's decimals
    fp = sum(c["float"]["quantgate_backcopy"]["perplexity"] for c in vanilla) / 3
    row = f"| tiny | vanilla | 0, 1, 2 | {fmt(fp)} | {mean:+.{d}f}% [{mean - half:+.{d}f}, {mean + half:+.{d}f}]"
    assert row in _report(recipe)


def _change(cell: dict, scheme: str) -> float:
    """The backcopy perplexity change ``scheme`` causes in a cpu_recipe cell."""
    fp = cell["float"]["quantgate_backcopy"]["perplexity"]
    return cell["schemes"][scheme]["results"]["quantgate_backcopy"]["perplexity"] / fp - 1


def test_compare_reads_study_runs(smoke_run):
    from quantgate.study.compare import compare

    table = compare([smoke_run])
    assert "| smoke:tiny | g1-headwise | 0 | float |" in table
    assert "| smoke:tiny | g1-headwise | 0 | w8a8-int8-static |" in table


def test_compare_matches_each_seed_with_its_own_float_run():
    from quantgate.study.compare import compare

    cells = json.loads((ROOT / "results" / "cpu_recipe" / "metrics.json").read_text())["cells"]
    seed1 = next(c for c in cells if c["id"] == "tiny/vanilla-seed1")
    q = seed1["schemes"]["w8a8-int8-static"]["results"]["quantgate_backcopy"]["perplexity"]
    row = next(
        line
        for line in compare([ROOT / "results" / "cpu_recipe"]).splitlines()
        if line.startswith("| cpu_recipe:tiny | vanilla | 1 | w8a8-int8-static |")
    )
    assert f"| {q:.4g} | {100 * _change(seed1, 'w8a8-int8-static'):+.2f}% [" in row  # against seed 1's float run


def test_quantized_records_missing_hardware_and_surfaces_other_errors(monkeypatch):
    import quantgate as qg
    from quantgate.quant import HardwareUnavailable
    from quantgate.study import steps
    from quantgate.study.steps import _quantized

    model = qg.build("tiny-llama")
    tok = qg.tokenizer(model)
    spec = load_study(SMOKE).models[0]

    def fail(error):
        def quantize(*args, **kwargs):
            raise error

        monkeypatch.setattr(steps, "quantize", quantize)  # the name the study step calls

    fail(HardwareUnavailable("w8-int8 cannot run here: no such GPU"))
    assert _quantized(model, tok, "w8-int8", spec.eval, spec, 0) == {"error": "w8-int8 cannot run here: no such GPU"}
    fail(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _quantized(model, tok, "w8-int8", spec.eval, spec, 0)


def test_against_baseline_pairs_each_variant_with_the_baseline_over_documents():
    """``report: baseline``: a variant's float perplexity relative to the baseline's (same model and seed)
    with the paired bootstrap over the documents both read, and its gate parameters as a multiple."""
    from quantgate.stats import format_delta, paired_delta
    from quantgate.study.report import Report, against_baseline

    def cell(variant, loglik, params):
        row = lambda sink: LayerRow(1.0, None, 1.0, sink, None, 0, max_median_ratio=1.0)
        docs = {"ids": [0, 1, 2, 3], "loglikelihood": loglik, "tokens": [10, 10, 10, 10]}
        ppl = math.exp(-sum(loglik) / 40)
        return {
            "id": f"m/{variant}",
            "model": "m",
            "variant": variant,
            "seed": 0,
            "schemes": {},
            "float": {"quantgate_backcopy": {"perplexity": ppl}},
            "float_documents": {"quantgate_backcopy": docs},
            "cost": {"gate_params": params, "gate_flops_per_token": 0.0},
            "observe": CellObserve(CellSummary(1.0, None, 1.0, 1.0, 0.3, None), [row(0.5), row(0.07)]).to_json(),
        }

    base, low = cell("g1-elementwise", [-12.0, -15.0, -9.0, -14.0], 800), cell("hyga", [-11.0, -15.5, -8.0, -13.0], 200)
    records = [CellRecord.from_json(c) for c in (base, low)]
    lines = against_baseline(
        Report.of(StudyRecord({"report": {"baseline": "g1-elementwise"}}, records, [], machine(), WallSeconds(0, 0)))
    ).splitlines()
    row = next(line for line in lines if line.startswith("| m | hyga |"))
    expected = paired_delta(
        base["float_documents"]["quantgate_backcopy"], low["float_documents"]["quantgate_backcopy"], "perplexity"
    )
    assert expected.value == pytest.approx(math.exp((50 - 47.5) / -40) - 1)  # ppl ratio by hand: exp(-2.5 / 40) - 1
    assert f"| {format_delta(expected)} | 200 (0.25x) | 0.50 (0) |" in row
    assert "| m | g1-elementwise | 0 | - | 800 (1.00x) |" in "\n".join(lines)
    assert against_baseline(Report.of(StudyRecord({}, records, [], machine(), WallSeconds(0, 0)))) == ""


def test_a_study_fine_tunes_a_loaded_checkpoint_with_a_gate_added(tmp_path):
    """load: + train: fine-tunes the checkpoint; a variant swapped in starts from Bondarenko's fine-tuning
    init (finetune=true), and both copies see the same data, steps and seed."""
    import quantgate as qg

    qg.save(qg.build("tiny-llama", seed=3), tmp_path / "base")
    study = tmp_path / "ft.yaml"
    study.write_text(
        "name: ft\nseed: 0\nmodels:\n  - name: base\n"
        f"    load: {tmp_path / 'base'}\n"
        '    variants: [vanilla, "g1-headwise:finetune=true"]\n'
        "    train: {steps: 2, batch_size: 2, seq_len: 16, lr: 0.001, eval_batches: 1}\n"
        "schemes: [w8-int8]\ncalibration: {batches: 1, seq_len: 16, batch_size: 2}\n"
        "observe: {batches: 1, seq_len: 16, batch_size: 2}\neval: {tasks: [quantgate_ppl], limit: 1}\n"
    )
    from quantgate.study.steps import plan

    assert f"fine-tune {tmp_path / 'base'} on train: 2 steps x 2 x 16 = 64 tokens" in plan(study)
    run = run_study(study, tmp_path / "run")
    cells = {c["variant"]: c for c in json.loads((run / "metrics.json").read_text())["cells"]}
    assert set(cells) == {"vanilla", "g1-headwise:finetune=true"}
    for variant, cell in cells.items():
        assert cell["trained"]["trained"] and cell["trained"]["steps"] == 2 and cell["trained"]["tokens"] == 64
        model = qg.load(run / "cells" / f"base--{variant.replace(':', '_').replace('=', '_')}" / "train" / "model")
        assert str(qg.variant_of(model)) == variant
    base, tuned = qg.load(tmp_path / "base"), qg.load(next((run / "cells").glob("base--vanilla")) / "train" / "model")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base.get_parameter(q_proj), tuned.get_parameter(q_proj))
