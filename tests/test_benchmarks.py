"""The benchmark scripts' shared timing (round-robin rounds, per-round ratios) and that each script runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_python

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import roundrobin  # noqa: E402


def test_sides_take_turns_and_warmup_rounds_are_not_timed():
    calls = []
    times = roundrobin.round_robin(
        {"a": lambda i: calls.append(("a", i)), "b": lambda i: calls.append(("b", i))}, rounds=3, warmup=2
    )
    assert calls == [(s, i) for i in range(5) for s in "ab"]
    assert [len(t) for t in times.values()] == [3, 3]


def test_ratio_is_the_median_of_per_round_ratios_with_its_quartiles():
    # a machine that slows 10x in round 3 moves both sides: the per-round ratio stays 2
    times = {"base": [1.0, 1.0, 10.0, 1.0, 1.0], "side": [2.0, 2.0, 20.0, 2.2, 1.8]}
    assert roundrobin.ratio(times, "side", "base") == "2.00x (IQR 1.90-2.10 over 5 rounds)"
    assert roundrobin.ratio({"b": [1.0, 2.0], "s": [3.0, 2.0]}, "s", "b") == "2.00x (range 1.00-3.00 over 2 rounds)"


@pytest.mark.parametrize(
    "script, args",
    [
        (
            "quant_speed.py",
            [
                "--model",
                "tiny-llama",
                "--schemes",
                "w8-int8",
                "w8a8-int8-static",
                "--rounds",
                "2",
                "--batches",
                "1",
                "--calib",
                "1",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
            ],
        ),
        (
            "observe_overhead.py",
            ["--model", "tiny-opt", "--rounds", "2", "--batches", "1", "--batch-size", "2", "--seq-len", "32"],
        ),
        (
            "speed.py",
            [
                *("--parts", "observe", "quant", "--models", "tiny-llama", "--tokens", "16"),
                *("--dtypes", "float32", "--rounds", "2"),
                *("--schemes", "w8a8-int8-static", "w4a4-nvfp4"),
            ],
        ),
    ],
)
def test_benchmark_scripts_print_their_ratio(script, args):
    run = run_python([str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "x (range" in run.stdout


def test_interval_width_prints_a_row_per_document_prefix():
    run = run_python(
        [str(BENCH / "interval_width.py"), "--model", "tiny-llama", "--docs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and "[n/a]" in rows[0] and "[n/a]" not in rows[1]
    assert rows[1].startswith("| 2 | 2 |") and "| approximate |" in rows[1]  # two works: below MIN_CLUSTERS


@pytest.mark.slow  # fifteen seconds: two models evaluated in float32 and bfloat16
def test_bf16_eval_sets_each_change_against_float32_on_the_same_documents(tmp_path, capsys):
    """The bf16 benchmark on a random tiny model: its paired differences are those of the two runs' documents."""
    import bf16_eval

    from quantgate.stats import format_delta, paired_difference
    from quantgate.study import read_metrics
    from quantgate.study.schema import DEFAULT_STUDY
    from quantgate.yaml_file import read_yaml

    bf16_eval.main(["--model", "tiny-llama", "--docs", "2", "--window", "512", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    cells = {c.model: c for c in read_metrics(tmp_path / "run").cells}
    assert set(cells) == {"float32", "bfloat16"}
    assert bf16_eval.TASK in read_yaml(DEFAULT_STUDY)[0]["models"][0]["eval"]["tasks"]  # the main job's task
    docs = lambda c, s: (c.float_documents[bf16_eval.TASK], c.scheme(s).documents[bf16_eval.TASK])
    for scheme in cells["float32"].schemes:
        gap = paired_difference(docs(cells["float32"], scheme), docs(cells["bfloat16"], scheme), "word_perplexity")
        assert f"| `{scheme}` |" in text and f" | {format_delta(gap)} | " in text
    assert "Criterion (declared in the script before its run)" in text


def test_main_job_benchmark_times_a_fresh_run_only(tmp_path):
    import main_job

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit, match="is not empty: the main job is timed from a fresh run directory"):
        main_job.main(["--out", str(tmp_path / "old")])


@pytest.mark.slow
def test_main_job_benchmark_prints_the_budget_share(tmp_path, capsys):
    import main_job

    main_job.main(
        ["--study", str(BENCH.parent / "experiments" / "smoke.yaml"), "--out", str(tmp_path / "run"), "--fresh-cache"]
    )
    out = capsys.readouterr().out
    assert "x the 10-minute budget (empty quantgate cache" in out and "  tiny/vanilla: " in out


def test_the_scale_fit_recovers_a_and_b_from_points_made_by_hand():
    import scale

    a, b, worst = scale.fit([(m, t, 1.5 * m + 2e4 * t) for m in (1e8, 5e8, 2e9) for t in (128, 512)])
    assert abs(a - 1.5) < 1e-9 and abs(b - 2e4) < 1e-3 and worst < 1e-9
    noisy = [(m, t, (1.5 * m + 2e4 * t) * (1.1 if m == 1e8 else 1.0)) for m in (1e8, 2e9) for t in (128, 512)]
    assert abs(scale.fit(noisy)[2] - 0.0) > 0.01  # a point off the plane shows in the worst residual


@pytest.mark.slow  # a minute: twelve measurements, each in a fresh process
def test_scale_dry_run_measures_fits_and_extrapolates(tmp_path):
    """The scale benchmark's dry run: every step measured in its own process, the fit, the marked extrapolation,
    and the report rebuilt from the measurements kept in --work."""
    run = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "--dry-run", "--work", str(tmp_path / "w"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text = (tmp_path / "scale-cpu-dry-run.md").read_text()
    assert "test the code path, not the memory model" in text and "## Extrapolation (not measured)" in text
    assert "| bfloat16 | quantize w8a8-int8-static inplace |" in text and "| 70B | forward |" in text
    rows = __import__("json").loads((tmp_path / "scale-dry-run.json").read_text())
    assert len(rows) == 2 * 2 * 3 and not any(r.get("failed") for r in rows)
    assert all(r["peak"] > r["model_bytes"] > 0 for r in rows if r["step"] != "load")
    again = subprocess.run(
        [
            sys.executable,
            str(BENCH / "scale.py"),
            "--dry-run",
            "--report-only",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "again"),
        ],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0 and "| 70B | forward |" in (tmp_path / "again" / "scale-cpu-dry-run.md").read_text()


@pytest.mark.slow  # 25 s: three runs of a page, one of them cold
def test_warm_tests_runs_a_page_three_ways_and_totals_them(tmp_path):
    import warm_tests

    page = "docs/guides/compare-quantized-checkpoints.md"
    warm_tests.main(["--pages", page, "--out", str(tmp_path / "w.md")])
    table = (tmp_path / "w.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith(f"| {page} |"))
    cold, inprocess, warm = (float(x) for x in row.strip("|").split("|")[1:])
    assert min(cold, inprocess, warm) > 0
    total = next(line for line in table.splitlines() if line.startswith("| **all pages** |"))
    assert [float(x.strip(" *")) for x in total.strip("|").split("|")[1:]] == [cold, inprocess, warm]  # one page
    found = re.search(
        r"own start \(one import, once per test session\): ([\d.]+) s\. Warm against in-process: (-?[\d.]+) s", table
    )
    assert found is not None, table
    start, saved = float(found[1]), float(found[2])
    assert saved == pytest.approx(inprocess - warm - start, abs=0.15)  # the printed values, each rounded to 0.1
    assert ("the server pays" in table) == (saved > 0) != ("the server does not pay" in table)
