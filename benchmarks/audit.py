"""``quantgate audit`` against its budget (issue 42): wall time and peak memory of an audit of SmolLM2-135M saved
by plain transformers (bfloat16, as the hub holds it), at budgets of 5 and 10 minutes, each into an empty folder;
then whether each audited change lies within the interval of the main job's row for the same scheme
(results/quickstart/metrics.json: the same model and documents, 24 of them).

    python benchmarks/audit.py --out results/bench/audit-smollm2-cpu.md     # the committed run (quiet machine)
    python benchmarks/audit.py --budgets 5m --model twin-vanilla --out /tmp/audit.md   # minutes

Each audit runs as its own ``quantgate audit`` process (its peak RSS from wait4's rusage); the page is written whole
by this script.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quantgate.audit import parse_budget
from quantgate.stats import format_delta
from quantgate.study import read_metrics
from quantgate.study.measures import ppl_change

ROOT = Path(__file__).resolve().parents[1]


def plain_smollm2(folder: Path) -> Path:
    """SmolLM2-135M written by transformers' own save_pretrained, in bfloat16 (what a user's folder holds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantgate.models.sources import resolve

    source = resolve("smollm2-135m")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def run(model: str, budget: str, out: Path) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (GiB, of this audit's process alone: wait4's rusage) and exit status of one audit."""
    start = time.perf_counter()
    child = subprocess.Popen(["quantgate", "audit", model, "--budget", budget, "--out", str(out)])
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 2**20, child.returncode  # ru_maxrss: kB on Linux


def agreement(out: Path, main_job: Path, model: str) -> list[str]:
    """Each scheme both ran: the audit's change, the main job's, and whether the first lies in the second's
    interval."""
    audited = read_metrics(out)
    reference = {c.model: c for c in read_metrics(main_job).cells}.get(model)
    if reference is None:
        return [f"(the main job has no {model} row to set the audit against)"]
    cell = audited.cells[-1]
    rows = ["| scheme | audit | main job | audit's estimate in the main job's interval |", "|---|---|---|---|"]
    for s in audited.schemes:
        a, m = ppl_change(cell, s), ppl_change(reference, s)
        if a is None or m is None or m.low is None or m.high is None:
            continue
        inside = "yes" if m.low <= a.value <= m.high else "no"
        rows.append(f"| `{s}` | {format_delta(a)} (n={a.n}) | {format_delta(m)} (n={m.n}) | {inside} |")
    return rows


def _gpu() -> str:
    return f"a GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the markdown page to write")
    ap.add_argument("--budgets", nargs="+", default=["5m", "10m"])
    ap.add_argument("--model", help="audit this instead of SmolLM2-135M saved by plain transformers")
    ap.add_argument(
        "--twins", nargs="*", default=["twin-vanilla", "twin-g1"], help="packaged twins to audit at the default budget"
    )
    ap.add_argument("--main-job", default=str(ROOT / "results" / "quickstart"), help="the main job's run directory")
    ap.add_argument("--main-model", default="smollm2-135m", help="the main job's model to set the audit against")
    args = ap.parse_args(argv)
    lines = [
        "# quantgate audit against its budget",
        "",
        f"Command: `python benchmarks/audit.py --out {args.out}`, on {platform.system()} {platform.machine()} with "
        f"{os.cpu_count()} CPUs and {_gpu()}"
        ". Each audit ran alone, into an empty folder, with the quantgate cache warm (the SmolLM2 conversion done).",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(plain_smollm2(Path(tmp) / "SmolLM2-135M"))
        lines += ["| budget | wall | wall / budget | peak RSS | exit |", "|---|---|---|---|---|"]
        answers = []
        for budget in args.budgets:
            out = Path(tmp) / f"audit-{budget}"
            wall, peak, code = run(model, budget, out)
            lines.append(f"| {budget} | {wall:.0f} s | {wall / parse_budget(budget):.2f}x | {peak:.2f} GiB | {code} |")
            answer = (out / "audit.md").read_text() if (out / "audit.md").is_file() else "(no audit.md)\n"
            answers += [f"## The audit at {budget}, as it wrote audit.md", "", "```text", answer.rstrip(), "```", ""]
            rows = agreement(out, Path(args.main_job), args.main_model)
            answers += [f"Against the main job's `{args.main_model}` rows:", "", *rows, ""]
        if args.twins:
            lines += ["", "The packaged twins at the default budget (10m; each audit covers the pair):", ""]
            lines += ["| model | wall | peak RSS | exit |", "|---|---|---|---|"]
        for twin in args.twins:
            out = Path(tmp) / f"audit-{twin}"
            wall, peak, code = run(twin, "10m", out)
            lines.append(f"| {twin} | {wall:.0f} s | {peak:.2f} GiB | {code} |")
            answer = (out / "audit.md").read_text() if (out / "audit.md").is_file() else "(no audit.md)\n"
            answers += [f"## The audit of {twin}, as it wrote audit.md", "", "```text", answer.rstrip(), "```", ""]
        text = "\n".join([*lines, "", *answers]).replace(tmp, "$TMP")
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
