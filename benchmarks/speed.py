"""What observing and simulated quantization cost, as ratios measured side by side in one run (issues 44, 55).

    python benchmarks/speed.py --rounds 4             # observe, quantization and cold-build tables (~30 min, 2 cores)
    python benchmarks/speed.py --parts observe --models smollm2-135m --tokens 128 --rounds 3   # a quick look

* ``observe``: ``qg.observe`` on one sequence against the forward it runs (the base model, no LM head:
  observe without labels computes no logits), random-init models of SmolLM2-135M and Qwen3-0.6B shape, at 128
  and 512 tokens, float32 and bfloat16. Target <= 1.2x. Beside it, the same observe on the eager path
  (``fused.eager()``: the statistics by torch ops, as before the fused kernels), and two floors: each tensor's
  statistics left out (its hooks, deduplication and report alone), and replaced by one read of each tensor
  (``x.abs().amax()``, one eager pass).
* ``quant``: a simulated scheme's forward against the float model's on the same sequence (1 x 128 and 1 x 512
  random token ids; static schemes calibrated on 2 such sequences), random-init models of SmolLM2-135M and
  Qwen3-0.6B shape, float32 and bfloat16, with the fused quantizer kernels (quantgate/quant/fused.py) and, beside
  them, on the eager path (``fused.eager()``: no kernels, and each quantizer computing its own values where
  q/k/v or gate/up share theirs on the fused side). One quantized copy at a time, timed in rounds with the float
  model. Targets: INT8/FP8 schemes <= 1.25x, FP4/MX/NVFP4 <= 2x.
* ``cold``: what the fused kernels cost before the first call: the build in a fresh process with an empty cache,
  and the load of the built library in another fresh process.

Each side takes one turn per round, round after round (benchmarks/roundrobin.py), after one untimed round; a
table cell is the median per-round ratio with its interquartile range, so a machine that slows down for a while
moves both sides alike. In-place quantization's memory is measured in fresh processes by
benchmarks/inplace_memory.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from roundrobin import ratio, round_robin

import quantgate as qg
from quantgate.models import build
from quantgate.models.families import config_of
from quantgate.quant import fused

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INT8_FP8 = ["w8a8-int8-static", "w8a8-int8-bondarenko", "w8a8-int8-dynamic", "w8a8-fp8-e4m3"]
FP4_MX = ["w8a8-mxfp8", "w4a4-mxfp4", "w4a4-nvfp4", "w4a4-fp4-e2m1"]
TARGET = {"observe": 1.2, **dict.fromkeys(INT8_FP8, 1.25), **dict.fromkeys(FP4_MX, 2.0)}


def _median(cell: str) -> float:
    return float(cell.split("x", 1)[0])


def _row(label: str, cell: str, target: float) -> str:
    verdict = "met" if _median(cell) <= target else "**over**"
    return f"| {label} | {cell} | <= {target}x: {verdict} |"


def _one_read(stats: Any, x: torch.Tensor, input_ids: torch.Tensor | None = None, valid: Any = None) -> float:
    """TensorStats.update's stand-in for a floor: one eager pass over ``x``, its largest |x|."""
    return float(x.abs().amax())


def _no_read(stats: Any, x: torch.Tensor, input_ids: torch.Tensor | None = None, valid: Any = None) -> float:
    """TensorStats.update's stand-in for the hooks' floor: ``x`` not read."""
    return 0.0


def observe_table(models: list[str], tokens: list[int], dtypes: list[str], rounds: int) -> list[str]:
    header = (
        "| model, dtype, tokens | observe / forward (fused) | target | observe / forward (eager) "
        "| floor: hooks alone | floor: one read per tensor |"
    )
    lines = [f"## observe / forward (fused kernels: {fused.status()})", "", header, "|---|---|---|---|---|---|"]
    stats_class = importlib.import_module("quantgate.observe").TensorStats  # qg.observe is the function
    full_update = stats_class.update
    for name in models:
        for dtype in dtypes:
            torch.manual_seed(0)
            model = build(name, dtype=DTYPES[dtype]).eval()
            for n in tokens:
                ids = torch.randint(5, config_of(model).vocab_size, (1, n))

                def forward(i: int, model=model, ids=ids) -> None:
                    with torch.no_grad():
                        model.base_model(input_ids=ids)

                def observe(i: int, model=model, ids=ids) -> None:
                    qg.observe(model, [{"input_ids": ids}], progress=False)

                def observe_eager(i: int, model=model, ids=ids) -> None:
                    with fused.eager():
                        qg.observe(model, [{"input_ids": ids}], progress=False)

                def floor(update: Any, model=model, ids=ids) -> Callable[[int], None]:
                    def call(i: int) -> None:
                        stats_class.update = update
                        try:
                            qg.observe(model, [{"input_ids": ids}], progress=False)
                        finally:
                            stats_class.update = full_update

                    return call

                sides: dict[str, Callable[[int], object]] = {"forward": forward, "observe": observe}
                sides.update(eager=observe_eager, hooks=floor(_no_read), read=floor(_one_read))
                times = round_robin(sides, rounds)
                row = _row(f"{name}, {dtype}, {n}", ratio(times, "observe", "forward"), TARGET["observe"])
                floors = " | ".join(ratio(times, side, "forward") for side in ("eager", "hooks", "read"))
                lines.append(f"{row} {floors} |")
                print(lines[-1], file=sys.stderr, flush=True)
            del model
    return lines


def quant_table(models: list[str], schemes: list[str], dtypes: list[str], tokens: list[int], rounds: int) -> list[str]:
    head = "| model, dtype, tokens, scheme | x float (fused) | target | x float (eager) |"
    lines = [f"## simulated scheme / float forward (fused kernels: {fused.status()})", "", head, "|---|---|---|---|"]
    for name in models:
        for dtype in dtypes:
            torch.manual_seed(0)
            model = build(name, dtype=DTYPES[dtype]).eval()
            vocab = config_of(model).vocab_size
            for n in tokens:
                batch = {"input_ids": torch.randint(5, vocab, (1, n))}
                calib = [{"input_ids": torch.randint(5, vocab, (1, n))} for _ in range(2)]

                def run(m, eager: bool = False, batch=batch) -> Callable[[int], None]:
                    def call(i: int) -> None:
                        with torch.no_grad(), fused.eager() if eager else contextlib.nullcontext():
                            m(**batch)

                    return call

                for scheme in schemes:  # one quantized copy at a time: Qwen3-0.6B's float32 copies are 2.4 GB each
                    needs = qg.quant.get_scheme(scheme).needs_calibration
                    options: dict[str, Any] = {"calib": 2} if needs else {}
                    quantized = qg.quantize(model, scheme, calibration=calib, **options)
                    sides: dict[str, Callable[[int], object]] = {"float": run(model), "fused": run(quantized)}
                    sides["eager"] = run(quantized, eager=True)
                    times = round_robin(sides, rounds)
                    row = _row(f"{name}, {dtype}, {n}, {scheme}", ratio(times, "fused", "float"), TARGET[scheme])
                    lines.append(f"{row} {ratio(times, 'eager', 'float')} |")
                    print(lines[-1], file=sys.stderr, flush=True)
                    del quantized, sides
            del model
    return lines


COLD = "import time; t = time.perf_counter(); from quantgate.quant import fused; s = fused.status(); "
COLD += "print(f'{time.perf_counter() - t:.1f}', s)"


def cold_table() -> list[str]:
    """The fused kernels' build in a fresh process with an empty cache, then their load in another."""
    lines = ["## the fused kernels before their first call", "", "| process | seconds | status |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "QUANTGATE_CACHE": cache}
        env.pop("QUANTGATE_COMPILE", None)
        for label in ("first (empty cache: build)", "second (built: load)"):
            out = subprocess.run([sys.executable, "-c", COLD], env=env, capture_output=True, text=True, check=True)
            seconds, status = out.stdout.strip().split(" ", 1)
            lines.append(f"| {label} | {seconds} | {status} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["observe", "quant", "cold"], choices=["observe", "quant", "cold"])
    ap.add_argument("--models", nargs="+", help="default: smollm2-135m qwen3-0.6b")
    ap.add_argument("--tokens", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--schemes", nargs="+", default=INT8_FP8 + FP4_MX, choices=INT8_FP8 + FP4_MX)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    print(
        f"# benchmarks/speed.py\n\nMachine: {platform.platform()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}. {args.rounds} round-robin rounds after one untimed round; median per-round "
        "ratio (IQR).\n",
        flush=True,
    )
    if (load := os.getloadavg()[0]) > 0.75 * (os.cpu_count() or 1):  # benchmarks are meant to run alone
        print(f"Load average at the start: {load:.1f} (other jobs share the cores: the ratios are noisy).\n")
    out = []
    if "observe" in args.parts:
        out += observe_table(args.models or ["smollm2-135m", "qwen3-0.6b"], args.tokens, args.dtypes, args.rounds)
        out.append("")
    if "quant" in args.parts:
        out += quant_table(
            args.models or ["smollm2-135m", "qwen3-0.6b"], args.schemes, args.dtypes, args.tokens, args.rounds
        )
        out.append("")
    if "cold" in args.parts:
        out += cold_table()
    print("\n".join(out))


if __name__ == "__main__":
    main()
