"""Training tokens/s of each attention variant relative to vanilla, same preset, same run.

    python benchmarks/train_throughput.py                     # small-llama, 8 x 128 tokens per step
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python benchmarks/train_throughput.py --rounds 30

One training step is what quantgate's trainer does per optimizer step: forward, backward, gradient
clipping and an AdamW step over the trainer's parameter groups. The variants take their steps in
round-robin order on the same batches, so drift in machine speed hits all of them alike; the table
gives the median over rounds after warm-up. Targets: elementwise gate <= 10% slower than vanilla,
headwise <= 3%. On 2-core CPU machines glibc malloc makes step times swing; jemalloc steadies them.
"""

from __future__ import annotations

import argparse

import torch
from roundrobin import median_time, ratio, round_robin

import quantgate as qg
from quantgate.train import TrainConfig, param_groups

VARIANTS = [
    "vanilla",
    "g1-elementwise",
    "g1-headwise",
    "g1-headshared",
    "g2-value",
    "g5-output",
    "bondarenko",
    "hyga:low_rank=16",
    "sink",
    "clipped",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    config = TrainConfig(lr=1e-3).resolved(qg.models.get_family(qg.models.PRESETS[args.preset].family).name)
    assert config.lr is not None and config.betas is not None  # resolved() fills them
    runs = {}
    for v in args.variants:
        model = qg.build(args.preset, v, seed=0).train()
        runs[v] = (model, torch.optim.AdamW(param_groups(model, config), lr=config.lr, betas=config.betas))
    data = list(
        qg.data.batches(
            qg.tokenizer(args.preset), "train", args.seq_len, args.batch_size, max_batches=args.rounds + args.warmup
        )
    )

    def step(model, opt):
        def run(i: int):
            model(**data[i]).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    times = round_robin({v: step(*run) for v, run in runs.items()}, args.rounds, args.warmup)
    tokens = args.batch_size * args.seq_len
    base = tokens / median_time(times, "vanilla")
    print(
        f"{args.preset}, {args.batch_size} x {args.seq_len} tokens per step, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} round-robin steps after {args.warmup} warm-up"
    )
    print(
        "| variant | tokens/s | x vanilla | slower by | step time x vanilla (median per round, IQR) |\n"
        "|---|---|---|---|---|"
    )
    for v in times:
        rate = tokens / median_time(times, v)
        print(
            f"| {v} | {rate:,.0f} | {rate / base:.3f} | {100 * (1 - rate / base):+.1f}% | "
            f"{ratio(times, v, 'vanilla')} |"
        )


if __name__ == "__main__":
    main()
