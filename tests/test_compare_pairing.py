"""compare pairs runs by identity: a quantized run with the float run whose weights' sha256 is its
recorded source, never two runs only because they share a name; lm-eval's own results JSON is read too."""

import json
import os
from pathlib import Path

import pytest

import quantgate as qg
from quantgate.cli import main
from quantgate.stats import change, format_delta, paired_delta
from quantgate.study.compare import collect_evals, compare

TASK = "quantgate_ppl"
METRIC = "word_perplexity"


def _write(out, tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "eval.json").write_text(json.dumps(out))
    return tmp_path / name


def _row(table, fragment):
    rows = [line for line in table.splitlines() if fragment in line]
    assert len(rows) == 1, rows
    return rows[0]


def test_pairs_by_source_hash_not_by_label(tmp_path):
    # two different float models, both labelled tiny-llama (in memory: build names them so)
    a, b = qg.build("tiny-llama", seed=0), qg.build("tiny-llama", seed=1)
    fa, fb = (qg.evaluate(m, tasks=TASK, limit=3).to_json() for m in (a, b))
    assert fa["settings"]["model"] == fb["settings"]["model"] == "tiny-llama"
    assert fa["settings"]["model_sha256"] != fb["settings"]["model_sha256"]
    _write(fa, tmp_path, "fp_a")
    _write(fb, tmp_path, "fp_b")
    # a quantgate-quantized checkpoint saved from b, evaluated from its folder
    qg.save(qg.quantize(b, "w8-int8"), tmp_path / "q_b")
    assert (
        main(["eval", str(tmp_path / "q_b"), "--tasks", TASK, "--limit", "3", "--out", str(tmp_path / "ev_q_b")]) == 0
    )
    qb = json.loads((tmp_path / "ev_q_b" / "eval.json").read_text())
    assert qb["settings"]["source_sha256"] == fb["settings"]["model_sha256"]
    # a quantized model of a third float model that no run evaluated, with the same label as the floats
    qc = qg.evaluate(qg.quantize(qg.build("tiny-llama", seed=2), "w8-int8"), tasks=TASK, limit=3).to_json()
    assert qc["settings"]["model"] == "tiny-llama" and qc["settings"]["quantization"] == "w8-int8"
    _write(qc, tmp_path, "q_c")

    table = compare([tmp_path])
    row = _row(table, f"| {tmp_path / 'q_b'} |")
    expected = paired_delta(fb["documents"][TASK], qb["documents"][TASK], METRIC)
    wrong = paired_delta(fa["documents"][TASK], qb["documents"][TASK], METRIC)
    assert expected.low is not None and format_delta(expected) != format_delta(wrong)
    short = fb["settings"]["model_sha256"][:12]
    assert f"| tiny-llama float (source sha256 {short}) |" in row and f"| {format_delta(expected)} |" in row
    unpaired = _row(table, "| tiny-llama | vanilla | - | w8-int8 |")
    assert f"none: no float run has sha256 {qc['settings']['source_sha256'][:12]}" in unpaired
    assert unpaired.endswith("| - |")
    floats = [line for line in table.splitlines() if line.startswith("| tiny-llama | vanilla | - | float |")]
    assert len(floats) == 2 and all(line.endswith("| - |") for line in floats)  # floats are references only
    # --baseline sets the reference for every other run; a's weights are not q_b's recorded source: refused,
    # unless --force-baseline, which says so in the row
    with pytest.raises(ValueError, match=r"recorded source sha256 .* --force-baseline"):
        compare([tmp_path], baseline=tmp_path / "fp_a" / "eval.json")
    forced = compare([tmp_path], baseline=tmp_path / "fp_a" / "eval.json", force_baseline=True)
    row = _row(forced, f"| {tmp_path / 'q_b'} |")
    assert "(--baseline, --force-baseline: its recorded source sha256" in row and f"| {format_delta(wrong)} |" in row
    assert forced.splitlines()[2].startswith("| tiny-llama | vanilla | - | float | baseline |")
    with pytest.raises(ValueError, match=r"--baseline .* holds 4 runs; name one run"):
        compare([tmp_path / "fp_a"], baseline=tmp_path)


def _lm_eval_run(model_dir: Path, out: Path, log_samples: bool) -> Path:
    """lm-eval's own results JSON (and samples), as ``lm_eval --model hf --output_path`` writes them."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(Path(qg.__file__).with_name("tasks")), include_defaults=False)
    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        device="cpu",
        tasks=[TASK, "quantgate_nextsent"],
        task_manager=tasks,
        limit=3,
        log_samples=log_samples,
        evaluation_tracker=tracker,
        bootstrap_iters=100,  # lm-eval computes its stderrs (none at 0)
        verbosity="ERROR",
    )
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
    if log_samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    (file,) = out.rglob("results_*.json")
    return file


def test_reads_lm_eval_results_with_stderr_and_samples(tmp_path):
    model_dir = qg.save(qg.build("tiny-llama"), tmp_path / "float")
    assert main(["eval", str(model_dir), "--tasks", TASK, "--limit", "3", "--out", str(tmp_path / "qg")]) == 0
    ours = json.loads((tmp_path / "qg" / "eval.json").read_text())
    file = _lm_eval_run(model_dir, tmp_path / "lm", log_samples=True)
    data = json.loads(file.read_text())
    assert "settings" not in data and data["config"]["model_args"].startswith(f"pretrained={model_dir}")

    (record,) = collect_evals([tmp_path / "lm"])
    assert record.kind == "lm-eval" and record.model == str(model_dir) and record.scheme == "float"
    assert record.values[f"{TASK}/{METRIC}"] == data["results"][TASK][f"{METRIC},none"]
    acc, acc_stderr = (data["results"]["quantgate_nextsent"][f"acc{s},none"] for s in ("", "_stderr"))
    assert record.stderr["quantgate_nextsent/acc"] == acc_stderr
    assert TASK in record.documents and len(record.documents[TASK]["ids"]) == 3

    table = compare([tmp_path / "lm"], baseline=tmp_path / "qg")
    row = _row(table, "(--baseline)")
    expected = paired_delta(ours["documents"][TASK], record.documents[TASK], METRIC)
    assert expected.low is not None and f"| {format_delta(expected)} |" in row
    assert f"| {acc:.4g} ± {acc_stderr:.4g} |" in row

    # without its samples files: the values and a point change, marked as one
    for samples in file.parent.glob("samples_*.jsonl"):
        os.remove(samples)
    table = compare([file], baseline=tmp_path / "qg" / "eval.json")
    point = change(METRIC, ours["results"][TASK][METRIC], data["results"][TASK][f"{METRIC},none"])
    assert point is not None and point.low is None and format_delta(point).endswith("[n/a]")
    assert f"| {format_delta(point)} |" in _row(table, "(--baseline)")
    assert f"{TASK}/{METRIC}: point change [n/a], no interval: one run kept per-document values" in table


def test_lm_eval_results_alone_pair_nothing(tmp_path):
    """An lm-eval file records no weights hash: it is a reference only through --baseline."""
    results = {
        "results": {TASK: {f"{METRIC},none": 10.0, f"{METRIC}_stderr,none": "N/A", "alias": TASK}},
        "configs": {TASK: {}},
        "versions": {TASK: 1},
        "config": {"model": "hf", "model_args": "pretrained=HuggingFaceTB/SmolLM2-135M,load_in_8bit=True"},
    }
    (tmp_path / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results))
    (record,) = collect_evals([tmp_path])
    assert record.model == "HuggingFaceTB/SmolLM2-135M" and record.scheme == "bitsandbytes:llm-int8(threshold=6.0)"
    assert record.stderr == {} and record.values[f"{TASK}/{METRIC}"] == 10.0
    assert "none: no source hash recorded; pass --baseline" in compare([tmp_path])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match=r"neither quantgate's eval\.json"):
        compare([tmp_path / "other.json"])
