"""Forward + backward time of every attention variant relative to vanilla, same model, same run.

    python benchmarks/variant_overhead.py                      # tiny-llama and small-llama on CPU
    python benchmarks/variant_overhead.py --presets small-opt --seq 256 --batch 8

Prints one table per preset: median milliseconds per training step (forward + backward, no
optimizer) and the ratio to vanilla measured in the same process. Timings interleave the variants
round by round so drift in machine speed affects all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import quantgate as qg
from quantgate.models.families import config_of

VARIANTS = [
    "vanilla",
    "clipped",
    "sink",
    "g1-elementwise",
    "g1-headwise",
    "g1-headshared",
    "g1-constant",
    "g1-ns-sigmoid",
    "g2-value",
    "g5-output",
    "bondarenko",
    "hyga",
    "hyga:low_rank=16+sink",
]


def step(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def bench(preset: str, variants: list[str], batch: int, seq: int, rounds: int, backend: str) -> dict[str, float]:
    models = {v: qg.build(preset, v, backend=backend).train() for v in variants}
    ids = torch.randint(5, config_of(models[variants[0]]).vocab_size, (batch, seq))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up
        step(models[v], ids)
    for _ in range(rounds):
        for v in variants:
            t0 = time.perf_counter()
            step(models[v], ids)
            times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(t) * 1e3 for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny-llama", "small-llama"])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x seq {args.seq}, "
        f"backend {args.backend}, median of {args.rounds} rounds"
    )
    for preset in args.presets:
        ms = bench(preset, args.variants, args.batch, args.seq, args.rounds, args.backend)
        base = ms["vanilla"] if "vanilla" in ms else min(ms.values())
        print(f"\n{preset}\n| variant | fwd+bwd ms | x vanilla |\n|---|---|---|")
        for v, t in ms.items():
            print(f"| {v} | {t:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
