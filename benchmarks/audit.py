"""``quantgate audit`` against its budget (issues 42 and 54): wall time and peak memory of an audit of SmolLM2-135M
saved by plain transformers (bfloat16, as the hub holds it), at the default 10 minutes and +1%, into an empty folder;
its answer as audit.md wrote it, the static-INT8 curve (tolerance against the fewest Linears kept, from audit.json),
and whether its export loads in plain ``from_pretrained`` (no quantgate code) with the weights ``qg.load`` reads.

    python benchmarks/audit.py --out results/bench/audit-smollm2-cpu.md --keep /tmp/smollm2-audit   # committed run
    python benchmarks/audit.py --budgets 5m --model twin-vanilla --twins --out /tmp/audit.md        # minutes

Each audit runs as its own ``quantgate audit`` process (its peak RSS from wait4's rusage); the page is written whole
by this script. ``--keep DIR`` keeps the last audit's folder (its export, for scripts/ecosystem/vllm_serve.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quantgate.audit import parse_budget
from quantgate.audit.record import AuditRecord

ROOT = Path(__file__).resolve().parents[1]


def plain_smollm2(folder: Path) -> Path:
    """SmolLM2-135M written by transformers' own save_pretrained, in bfloat16 (what a user's folder holds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantgate.models.sources import resolve

    source = resolve("smollm2-135m")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def run(model: str, budget: str, out: Path, serve: str = "any") -> tuple[float, float, int]:
    """Wall seconds, peak RSS (GiB, of this audit's process alone: wait4's rusage) and exit status of one audit."""
    start = time.perf_counter()
    child = subprocess.Popen(["quantgate", "audit", model, "--budget", budget, "--out", str(out), "--serve", serve])
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 2**20, child.returncode  # ru_maxrss: kB on Linux


def curve(out: Path) -> list[str]:
    """audit.json's static-INT8 curve: per tolerance, the fewest Linears kept and that recipe's change."""
    path = out / "audit.json"
    if not path.is_file():
        return ["(no audit.json)"]
    record = AuditRecord.from_json(json.loads(path.read_text()))
    rows = ["| tolerance | fewest Linears kept in 16-bit | change on the search passages [95% CI] |", "|---|---|---|"]
    for p in record.curve:
        c = p.change
        change = (
            "-"
            if c is None or c.low is None or c.high is None
            else (f"{100 * c.value:+.2f}% [{100 * c.low:+.2f}, {100 * c.high:+.2f}]")
        )
        rows.append(f"| +{p.tolerance:.0%} | {p.kept if p.kept is not None else 'not found in the time'} | {change} |")
    return rows if record.curve else ["(no curve: static INT8 was within, or its fallback was cut by the budget)"]


def loads_plain(export: Path) -> str:
    """Whether plain transformers loads ``export`` with the quantized weights qg.load reads, bit for bit."""
    if not (export / "config.json").is_file():
        return "no export"
    from transformers import AutoModelForCausalLM

    import quantgate as qg

    plain = AutoModelForCausalLM.from_pretrained(export).eval()
    ours = qg.load(export, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        plain(torch.randint(5, 1000, (1, 8)))  # plain transformers decompresses at its first forward
    a = {n: m.weight for n, m in plain.named_modules() if n.endswith("proj")}
    b = {n: m.weight for n, m in ours.named_modules() if n.endswith("proj")}
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    return f"plain from_pretrained loads it; its {len(a)} projections equal qg.load's bit for bit: {same}"


def _gpu() -> str:
    return f"a GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the markdown page to write")
    ap.add_argument("--budgets", nargs="+", default=["10m"])
    ap.add_argument("--model", help="audit this instead of SmolLM2-135M saved by plain transformers")
    ap.add_argument(
        "--twins", nargs="*", default=["twin-vanilla", "twin-g1"], help="packaged twins to audit at the default budget"
    )
    ap.add_argument("--keep", help="copy the last audit's folder here")
    ap.add_argument("--serve", default="any", help="the audits' serving target (quantgate audit --serve)")
    args = ap.parse_args(argv)
    lines = [
        "# quantgate audit against its budget",
        "",
        f"Command: `python benchmarks/audit.py --out {args.out}"
        + (f" --serve {args.serve}" if args.serve != "any" else "")
        + f"`, on {platform.system()} {platform.machine()} with "
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
            wall, peak, code = run(model, budget, out, args.serve)
            lines.append(f"| {budget} | {wall:.0f} s | {wall / parse_budget(budget):.2f}x | {peak:.2f} GiB | {code} |")
            answer = (out / "audit.md").read_text() if (out / "audit.md").is_file() else "(no audit.md)\n"
            answers += [f"## The audit at {budget}, as it wrote audit.md", "", "```text", answer.rstrip(), "```", ""]
            answers += [
                "Static INT8's curve (audit.json):",
                "",
                *curve(out),
                "",
                f"Export: {loads_plain(out / 'export')}.",
                "",
            ]
            if args.keep:
                shutil.copytree(out, args.keep, dirs_exist_ok=True)
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
