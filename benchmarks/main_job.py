"""The main job's wall time against its 10-minute budget (issue 32): ``quantgate study`` on the embedded default,
into an empty run directory, optionally with an empty quantgate cache too (the SmolLM2 conversion and the token
caches then count, as on a fresh machine).

    python benchmarks/main_job.py --out results/quickstart --fresh-cache   # the committed run (quiet machine)
    python benchmarks/main_job.py --study experiments/smoke.yaml --out /tmp/x   # seconds (CI)

Prints the wall time, its share of the budget, and each cell's step seconds (from its metrics.json).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantgate.study import read_metrics

BUDGET_S = 600.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", help="a study file (default: the embedded default, the main job)")
    ap.add_argument("--out", required=True, help="run directory; must not exist or be empty (a fresh run)")
    ap.add_argument("--fresh-cache", action="store_true", help="an empty QUANTGATE_CACHE for the run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} is not empty: the main job is timed from a fresh run directory; move it away first")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if args.fresh_cache:
            env["QUANTGATE_CACHE"] = cache
        cmd = ["quantgate", "study", *([args.study] if args.study else []), "--out", str(out)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        wall = time.perf_counter() - start
    cells = read_metrics(out).cells
    print(
        f"main job: {wall:.0f} s wall = {wall / BUDGET_S:.2f}x the {BUDGET_S / 60:.0f}-minute budget "
        f"({'empty' if args.fresh_cache else 'warm'} quantgate cache, {os.cpu_count()} CPUs); steps per cell:"
    )
    for c in cells:
        print(f"  {c.id}: {c.seconds:.0f} s")


if __name__ == "__main__":
    main()
