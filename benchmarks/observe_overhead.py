"""observe time / plain forward time on the same batches, same run (target <= 1.5x).

    python benchmarks/observe_overhead.py                         # small-llama, 4 batches of 8 x 256
    python benchmarks/observe_overhead.py --model smollm2-135m --seq-len 128

Both sides run under torch.no_grad over the same batches and take turns, one pass each per round
(benchmarks/roundrobin.py); the ratio is the median per-round ratio with its interquartile range, so a
busy machine moves both sides alike.
"""

from __future__ import annotations

import argparse

import torch
from roundrobin import median_time, ratio, round_robin

import quantgate as qg
from quantgate.data import batches
from quantgate.observe import observe


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama", help="preset, packaged model or directory")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4, help="batches per pass")
    ap.add_argument("--rounds", type=int, default=8, help="passes of each side, taking turns")
    args = ap.parse_args(argv)
    from quantgate.model_files import load_or_build

    model = load_or_build(args.model, args.variant).eval()
    data = list(batches(qg.tokenizer(model), "validation", args.seq_len, args.batch_size, max_batches=args.batches))

    def forward(i: int):
        with torch.no_grad():
            for b in data:
                model(**b)

    times = round_robin({"forward": forward, "observe": lambda i: observe(model, data, progress=False)}, args.rounds)
    print(
        f"{args.model} ({qg.variant_of(model)}), {args.batches} batches of {args.batch_size} x {args.seq_len}, "
        f"{torch.get_num_threads()} threads, {args.rounds} round-robin rounds"
    )
    print(
        f"plain forward {median_time(times, 'forward'):.2f} s | observe {median_time(times, 'observe'):.2f} s per "
        f"pass | ratio {ratio(times, 'observe', 'forward')} (target <= 1.5x)"
    )


if __name__ == "__main__":
    main()
