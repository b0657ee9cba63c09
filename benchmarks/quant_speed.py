"""Forward time of quantized models relative to the float model, same batches, same run (CPU).

    python benchmarks/quant_speed.py                     # small-llama, batches of 8 x 128, 12 rounds
    python benchmarks/quant_speed.py --model smollm2-135m --schemes w8a8-int8-static torchao-int8-dynamic

Simulated schemes measure the cost of the research instrument (fake quantization on float kernels);
real-kernel schemes measure what torchao / bitsandbytes deliver on this machine's CPU. The float model
and every scheme take turns on the same batch in each round (benchmarks/roundrobin.py), and the table
gives the median per-round ratio with its interquartile range, so a busy machine moves both sides
alike. Target: simulated W8A8 with Bondarenko's placement within 2x of float. A folded mitigation
(SmoothQuant, the residual rotation) should cost what its base scheme costs; the online Hadamard adds
one fast transform per FFN; the MX / NVFP4 emulation casts every activation block by block.
"""

from __future__ import annotations

import argparse

import torch
from roundrobin import median_time, ratio, round_robin

import quantgate as qg
from quantgate.data import batches

SCHEMES = [
    "w8a8-int8-static",
    "w8a8-int8-bondarenko",
    "w8a8-int8-dynamic",
    "w8a8-fp8-e4m3",
    "torchao-int8-dynamic",
    "torchao-int8-weight-only",
    "llm-int8",
    # the mitigations and block-scaled formats (experiments/mitigations.yaml)
    "w8a8-int8-static:smooth=0.5",
    "w8a8-int8-static:rotate=residual",
    "w8a8-int8-static:rotate=online",
    "w8a8-int8-static:keep=auto",
    "w8a8-mxfp8",
    "w4a4-mxfp4",
    "w4a4-nvfp4",
    "w4a4-fp4-e2m1",
    "kv4-int4",
    "kv4-int4:sink=1",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--schemes", nargs="+", default=SCHEMES)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, used in turn")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calib", type=int, default=4, help="calibration batches of the static schemes")
    args = ap.parse_args(argv)
    from quantgate.model_files import load_or_build

    model = load_or_build(args.model, None).eval()
    tok = qg.tokenizer(model)
    data = [
        {k: v for k, v in b.items() if k != "labels"}
        for b in batches(tok, "validation", args.seq_len, args.batch_size, max_batches=args.batches)
    ]
    calib = batches(tok, "train", args.seq_len, args.batch_size)
    models = {"float": model}
    for name in args.schemes:
        needs = qg.quant.get_scheme(name).needs_calibration
        models[name] = qg.quantize(model, name, calibration=calib, **({"calib": args.calib} if needs else {}))

    def forward(m):
        def run(i: int):
            with torch.no_grad():
                m(**data[i % len(data)])

        return run

    times = round_robin({name: forward(m) for name, m in models.items()}, args.rounds)
    print(
        f"{args.model}, batches of {args.batch_size} x {args.seq_len}, {torch.get_num_threads()} threads, "
        f"{args.rounds} round-robin rounds; float forward {median_time(times, 'float') * 1e3:.0f} ms per batch"
    )
    print("| scheme | ms per batch | x float (median per round, IQR) |\n|---|---|---|")
    for name in args.schemes:
        print(f"| {name} | {median_time(times, name) * 1e3:.0f} | {ratio(times, name, 'float')} |")


if __name__ == "__main__":
    main()
