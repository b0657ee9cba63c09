"""observe time / plain forward time on the same batches, same run (target <= 1.5x).

    python benchmarks/observe_overhead.py                         # small-llama, 4 batches of 8 x 256
    python benchmarks/observe_overhead.py --model smollm2-135m --seq-len 128

Both loops run under torch.no_grad on identical batches; each is timed twice and the faster
pass is kept, so one-off warm-up costs do not count against either side.
"""

from __future__ import annotations

import argparse
import time

import torch

import quantgate as qg
from quantgate.data import batches
from quantgate.observe import observe


def timed(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama", help="preset, packaged model or directory")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    from quantgate.cli import _load_or_build

    model = _load_or_build(args.model, args.variant).eval()
    data = list(batches(qg.tokenizer(model), "validation", args.seq_len, args.batch_size,
                        max_batches=args.batches))

    def forward():
        with torch.no_grad():
            for b in data:
                model(**b)

    forward()  # warm-up
    t_fwd = timed(forward)
    t_obs = timed(lambda: observe(model, data, progress=False))
    print(f"{args.model} ({qg.variant_of(model)}), {args.batches} batches of {args.batch_size} x {args.seq_len}, "
          f"{torch.get_num_threads()} threads")
    print(f"plain forward {t_fwd:.2f} s | observe {t_obs:.2f} s | ratio {t_obs / t_fwd:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
