"""Forward time of quantized models relative to the float model, same batches, same run (CPU).

    python benchmarks/quant_speed.py                     # small-llama, 4 batches of 8 x 128
    python benchmarks/quant_speed.py --model smollm2-135m --schemes w8a8-int8-static torchao-int8-dynamic

Simulated schemes measure the cost of the research instrument (fake quantization on float kernels);
real-kernel schemes measure what torchao / bitsandbytes deliver on this machine's CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

import quantgate as qg
from quantgate.data import batches


def forward_time(model, data, repeats: int = 2) -> float:
    best = float("inf")
    with torch.no_grad():
        model(**data[0])  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            for b in data:
                model(**b)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--schemes", nargs="+", default=["w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3",
                                                     "torchao-int8-dynamic", "torchao-int8-weight-only", "llm-int8"])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    from quantgate.cli import _load_or_build

    model = _load_or_build(args.model, None).eval()
    tok = qg.tokenizer(model)
    data = [{k: v for k, v in b.items() if k != "labels"}
            for b in batches(tok, "validation", args.seq_len, args.batch_size, max_batches=args.batches)]
    calib = batches(tok, "train", args.seq_len, args.batch_size)
    base = forward_time(model, data)
    print(f"{args.model}, {args.batches} batches of {args.batch_size} x {args.seq_len}, {torch.get_num_threads()} "
          f"threads; float forward {base:.2f} s")
    print("| scheme | forward s | x float |\n|---|---|---|")
    for name in args.schemes:
        q = qg.quantize(model, name, calibration=calib, **({"calib": 4} if qg.SCHEMES[name].needs_calibration else {}))
        t = forward_time(q, data)
        print(f"| {name} | {t:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
