"""Does the tests' fork server (tests/_warm_quantgate.py) pay? The docs' pages (tests/test_doc_blocks.py) run three
ways, each page by each way in turn (tests/../benchmarks/roundrobin.py's rounds, a page a round):

* ``cold``: the driver and each ``quantgate`` command a plain process, each importing the package;
* ``in-process``: the driver a plain process; a bash block made only of ``quantgate ...`` lines runs each line through
  ``quantgate.cli.main`` inside the driver (which imported quantgate for the page's python blocks), and a block with
  anything else (a pipe, ``grep``, ``cat``) runs in bash as before;
* ``warm``: the driver and each command forked from the server that imported quantgate once (what the tests do).

Seconds per page and in all; the verdict: the server pays where ``warm`` takes less time than ``in-process`` over the
pages, its own start included. ``python benchmarks/warm_tests.py [--rounds N] [--out results/bench/warm_tests-cpu.md]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_doc_blocks as pages  # noqa: E402
from _warm_quantgate import Warm  # noqa: E402


def _inprocess_shim() -> None:
    """Prepended to the driver's source: ``bash -euo pipefail -c TEXT`` where every line of TEXT is one plain
    ``quantgate ARGS`` (no shell syntax) runs those lines through quantgate.cli.main here, its streams the block's."""
    import os
    import re
    import shlex
    import subprocess
    import sys

    real = subprocess.Popen

    class Finished:
        def __init__(self, code: int) -> None:
            self.returncode, self.pid = code, os.getpid()

        def wait(self, timeout: float | None = None) -> int:
            return self.returncode

    def commands(text: str) -> list[list[str]] | None:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if not lines or any(not ln.startswith("quantgate ") or re.search(r"[|&;<>$`*?\\]", ln) for ln in lines):
            return None
        return [shlex.split(ln)[1:] for ln in lines]

    def popen(args, **kwargs):
        argvs = commands(args[-1]) if list(args[:3]) == ["bash", "-euo", "pipefail"] else None
        if argvs is None:
            return real(args, **kwargs)
        from quantgate.cli import main

        saved = os.dup(1), os.dup(2)
        os.dup2(kwargs["stdout"].fileno(), 1)
        os.dup2(kwargs["stderr"].fileno(), 2)
        code = 0
        try:
            for argv in argvs:
                try:
                    code = main(argv) or 0
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                if code:
                    break
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        return Finished(code)

    subprocess.Popen = popen  # type: ignore[misc,assignment]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results/bench/warm_tests-cpu.md")
    ap.add_argument("--pages", nargs="*", help="only these pages (paths from the repository root); default: all")
    args = ap.parse_args(argv)
    import inspect
    import textwrap

    shim = textwrap.dedent(inspect.getsource(_inprocess_shim)) + "\n_inprocess_shim()\n"
    listed = [
        p
        for p in pages.doc_pages()
        if any(b.runs and not b.slow for b in pages.parse_page(p.read_text(), ""))
        and (not args.pages or pages.relative(p) in args.pages)
    ]
    tmp = Path(tempfile.mkdtemp(prefix="warm-tests-"))
    server = Warm(tmp / "server", pages.page_env(), shim=True)
    t0 = time.perf_counter()
    if not server.start():
        sys.exit("the warm server did not start")
    started = time.perf_counter() - t0
    ways = ["cold", "in-process", "warm"]
    seconds: dict[str, dict[str, list[float]]] = {w: {pages.relative(p): [] for p in listed} for w in ways}
    try:
        for r in range(args.rounds):
            for i, page in enumerate(listed):
                for way in ways[i % 3 :] + ways[: i % 3]:  # each way goes first on a third of the pages
                    t = time.perf_counter()
                    warm = server if way == "warm" else None
                    pages.run_page(page, tmp / f"{way}-{r}-{i}", warm=warm, prelude=shim if way == "in-process" else "")
                    seconds[way][pages.relative(page)].append(time.perf_counter() - t)
                    print(f"round {r} {pages.relative(page)} {way}: {seconds[way][pages.relative(page)][-1]:.1f} s")
    finally:
        server.stop()
    med = {w: {p: statistics.median(s) for p, s in seconds[w].items()} for w in ways}
    total = {w: sum(med[w].values()) for w in ways}
    rows = [f"| {p} | " + " | ".join(f"{med[w][p]:.1f}" for w in ways) + " |" for p in med["cold"]]
    verdict = "pays" if total["warm"] + started < total["in-process"] else "does not pay"
    text = "\n".join(
        [
            "# The tests' fork server against running the docs' commands in-process",
            "",
            f"`python benchmarks/warm_tests.py --rounds {args.rounds}` on {platform.node()} "
            f"({platform.processor() or platform.machine()}), Python {platform.python_version()}; "
            f"{len(listed)} pages, their default blocks; median seconds per page over {args.rounds} round(s), "
            "the three ways taking turns on each page.",
            "",
            "| page | cold | in-process | warm |",
            "|---|---:|---:|---:|",
            *rows,
            f"| **all pages** | **{total['cold']:.1f}** | **{total['in-process']:.1f}** | **{total['warm']:.1f}** |",
            "",
            f"The server's own start (one import, once per test session): {started:.1f} s. Warm against in-process: "
            f"{total['in-process'] - total['warm'] - started:.1f} s saved after paying for its start: the server "
            f"{verdict}.",
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
