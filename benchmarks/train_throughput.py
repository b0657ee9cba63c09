"""Training tokens/s of each attention variant relative to vanilla, same preset, same run.

    python benchmarks/train_throughput.py                     # small-llama, 8 x 128 tokens per step
    python benchmarks/train_throughput.py --preset small-opt --steps 30

Each variant trains with quantgate's trainer (AdamW, clipping, schedule) for --steps steps; the
rate is taken from the trainer's own log after the first --skip steps, and the variants run in
alternating order twice so machine drift affects all alike. Targets: elementwise gate <= 10%
slower than vanilla, headwise <= 3%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import quantgate as qg
from quantgate.train import TrainConfig, train

VARIANTS = ["vanilla", "g1-elementwise", "g1-headwise", "g1-headshared", "g2-value", "g5-output", "bondarenko",
            "hyga:low_rank=16", "sink", "clipped"]


def rate(preset: str, variant: str, args) -> float:
    with tempfile.TemporaryDirectory() as out:
        model = qg.build(preset, variant, seed=0)
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3, eval_data=None,
                          log_every=1, out=out)
        train(model, qg.tokenizer(model), config=cfg)
        log = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
        return statistics.median(r["tokens_per_s"] for r in log if r["event"] == "train" and r["step"] > args.skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    rates = {v: [] for v in args.variants}
    for order in (args.variants, args.variants[::-1]):
        for v in order:
            rates[v].append(rate(args.preset, v, args))
    base = statistics.mean(rates["vanilla"])
    print(f"{args.preset}, {args.batch_size} x {args.seq_len} tokens per step, {torch.get_num_threads()} threads, "
          f"median tokens/s of steps {args.skip + 1}-{args.steps}, two runs each")
    print("| variant | tokens/s | x vanilla | slower by |\n|---|---|---|---|")
    for v, r in rates.items():
        m = statistics.mean(r)
        print(f"| {v} | {m:,.0f} | {m / base:.3f} | {100 * (1 - m / base):+.1f}% |")


if __name__ == "__main__":
    main()
