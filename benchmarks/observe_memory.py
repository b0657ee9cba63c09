"""Peak memory of observe at long context against a plain forward pass of the same model.

    python benchmarks/observe_memory.py      # smollm2-135m, one sequence of 2k .. 32k tokens: observe vs base
    python benchmarks/observe_memory.py --modes forward --lengths 2048 4096 8192      # with the logits
    python benchmarks/observe_memory.py --model tiny-llama --modes observe eager --lengths 1024 2048 4096 8192

Each measurement runs in a fresh subprocess: it loads the model (preset, packaged model or directory),
runs a 16-token warm-up so the weights are paged in, resets the kernel's peak-RSS counter
(/proc/self/clear_refs) and reports the peak resident memory of one forward pass at N tokens beyond
the resident memory after loading (MiB). Modes:

* ``observe``: ``qg.observe`` without labels (statistics, sink mass; no LM head);
* ``base``: the base model's forward (no LM head): what observe adds its hooks to;
* ``forward``: ``model(ids)``, a plain forward with the full-vocabulary logits (N x vocab floats);
* ``eager``: transformers' eager attention with ``output_attentions`` (heads x N x N per layer);
  fitted with a * N^2 to tell where it would exhaust this machine's memory.

The slope column is the growth per 1k tokens from the previous length (MiB). glibc keeps freed
blocks below its (adaptive, up to 32 MiB) mmap threshold in the heap, which adds a few hundred MiB
of noise at short lengths; MALLOC_MMAP_THRESHOLD_=65536 in the environment takes that out.
On two CPU cores a 32k-token forward of smollm2-135m takes about half an hour (attention is N^2).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import Any, cast


def kib(field: str, path: str = "/proc/self/status") -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM) or /proc/meminfo (MemTotal)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(mode: str, model_name: str, n: int) -> dict:
    """Peak RSS growth (MiB) of one forward pass at length n, and its seconds (runs in this process)."""
    import torch
    from transformers import PreTrainedModel

    from quantgate.model_files import load_or_build
    from quantgate.observe import observe

    model = cast(PreTrainedModel, load_or_build(model_name, None).eval())  # a transformers model
    if mode == "eager":
        model.set_attn_implementation("eager")

    def run(ids):
        with torch.no_grad():
            if mode == "observe":
                observe(model, [{"input_ids": ids}], progress=False)
            elif mode == "base":
                model.base_model(ids)
            elif mode == "forward":
                assert model(ids).logits.shape[1] == ids.shape[1]
            else:
                assert model(ids, output_attentions=True).attentions[0].shape[-1] == ids.shape[1]

    ids = torch.randint(5, model.config.vocab_size, (1, n))
    run(ids[:, :16])  # pages the weights in, builds lazy state
    base = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    t0 = time.perf_counter()
    run(ids)
    return {"mib": (kib("VmHWM") - base) / 1024, "s": time.perf_counter() - t0, "model_mib": base / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="preset, packaged model or directory")
    ap.add_argument("--modes", nargs="+", default=["observe", "base"], choices=["observe", "base", "forward", "eager"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, model_name, n = args.child
        print(json.dumps(measure(mode, model_name, int(n))))
        return
    t0 = time.perf_counter()
    rows: dict[tuple[int, str], dict[str, Any] | None] = {}
    for n in args.lengths:
        for mode in args.modes:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, args.model, str(n)], capture_output=True, text=True
            )
            if out.returncode:
                print(f"{mode} at {n} tokens failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
                rows[n, mode] = None
            else:
                rows[n, mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{mode} at {n} tokens: {rows[n, mode]}", file=sys.stderr, flush=True)  # progress
    done = [r for r in rows.values() if r]
    total = kib("MemTotal", "/proc/meminfo") / 1024
    print(
        f"{args.model}, batch 1, {args.modes}; peak RSS growth over the loaded model "
        f"({done[0]['model_mib']:.0f} MiB resident after loading and warm-up) in MiB; machine memory {total:.0f} MiB"
    )
    print("| tokens | " + " | ".join(f"{m} MiB | {m} MiB/1k tok | {m} s" for m in args.modes) + " |")
    print("|---|" + "---|---|---|" * len(args.modes))
    for i, n in enumerate(args.lengths):
        cells = []
        for mode in args.modes:
            r, prev = rows[n, mode], rows.get((args.lengths[i - 1], mode)) if i else None
            slope = (r["mib"] - prev["mib"]) / ((n - args.lengths[i - 1]) / 1024) if r and prev else None
            cells += [
                f"{r['mib']:.0f}" if r else "failed",
                f"{slope:.1f}" if slope is not None else "-",
                f"{r['s']:.1f}" if r else "-",
            ]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if "eager" in args.modes and len(args.lengths) > 1:
        (n1, n2) = args.lengths[-2:]
        e1, e2 = rows[n1, "eager"], rows[n2, "eager"]
        a = (e2["mib"] - e1["mib"]) / (n2**2 - n1**2) if e1 and e2 else 0.0  # eager grows as a * N^2
        if a > 0:
            assert e2 is not None  # a > 0 only where both lengths ran
            limit = math.sqrt(max(total - e2["mib"] + a * n2**2, 0) / a)
            print(
                f"eager grows ~{a * 1024**2:.0f} MiB per (1k tokens)^2: it would exceed {total:.0f} MiB near "
                f"N = {limit:,.0f} tokens"
            )
    print(f"benchmark wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
