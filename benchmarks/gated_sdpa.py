"""Fused gated attention (Triton) against SDPA, SDPA + gate multiply, and that under torch.compile.

    python benchmarks/gated_sdpa.py                 # CUDA, bf16, causal; writes results/bench/gated_sdpa.md
    python benchmarks/gated_sdpa.py --dry-run       # CPU, Triton interpreter, fp32, tiny shapes (CI)

For each (B, H, N, D) it times forward and forward + backward of
  (a) ungated torch SDPA (the floor), (b) SDPA then ``out * gate`` (today's practice),
  (c) (b) under torch.compile, (d) quantgate's fused kernel (gate in the epilogue),
and prints attention TFLOP/s (causal: half of 4*B*H*N^2*D forward, 2.5x that backward), the time
ratios of (d) to (a) and (b), and the max error of (c) and (d) against (b) computed in float32.
Targets: (d) <= 1.05x (a); (b) >= 1.2x (d) in the forward.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F

from quantgate.attention.triton_sdpa import flash_gated_sdpa

SHAPES = [(8, 16, 1024, 128), (2, 16, 4096, 128), (1, 16, 16384, 128), (4, 16, 4096, 64)]
DRY_SHAPES = [(1, 2, 24, 32)]


def ungated(q, k, v, g):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gated(q, k, v, g):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * g


def fused(q, k, v, g):
    return flash_gated_sdpa(q, k, v, g, is_causal=True)[0]


def timer(device: str, reps: int):
    """ms per call of fn (median), with CUDA events on a GPU and the wall clock on a CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3

    return wall


def inputs(shape, dtype, device, seed=0):
    b, h, n, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)
    q, k, v = make(b, h, n, d), make(b, h, n, d), make(b, h, n, d)
    gate = torch.sigmoid(make(b, h, n, d))
    return [t.requires_grad_() for t in (q, k, v, gate)], make(b, h, n, d)


def bench_shape(shape, dtype, device, compile_backend, measure):
    (q, k, v, gate), dout = inputs(shape, dtype, device)
    methods = {
        "(a) sdpa, ungated": ungated,
        "(b) sdpa * gate": gated,
        "(c) compiled (b)": torch.compile(gated, backend=compile_backend),
        "(d) fused triton": fused,
    }
    b, h, n, d = shape
    fwd_flops = 4 * b * h * n * n * d / 2  # causal
    rows = {}
    for name, fn in methods.items():
        with torch.no_grad():
            t_fwd = measure(lambda fn=fn: fn(q, k, v, gate))

        def step(fn=fn):
            for t in (q, k, v, gate):
                t.grad = None
            fn(q, k, v, gate).backward(dout)

        t_all = measure(step)
        rows[name] = {
            "fwd_ms": t_fwd,
            "fwdbwd_ms": t_all,
            "fwd_tflops": fwd_flops / t_fwd / 1e9,
            "fwdbwd_tflops": 3.5 * fwd_flops / t_all / 1e9,
        }
    with torch.no_grad():  # accuracy against (b) in float32
        ref = gated(*(t.float() for t in (q, k, v, gate)))
        for name in ("(c) compiled (b)", "(d) fused triton"):
            rows[name]["max_err"] = (methods[name](q, k, v, gate).float() - ref).abs().max().item()
        rows["(b) sdpa * gate"]["max_err"] = (gated(q, k, v, gate).float() - ref).abs().max().item()
    return rows


def table(results: dict, header: str) -> str:
    lines = [
        header,
        "",
        "| B, H, N, D | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
        "fwd / (a) | fwd / (b) | fwd+bwd / (a) | fwd+bwd / (b) | max err vs fp32 (b) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for shape, rows in results.items():
        a, b_ = rows["(a) sdpa, ungated"], rows["(b) sdpa * gate"]
        for name, r in rows.items():
            err = f"{r['max_err']:.2e}" if "max_err" in r else ""
            lines.append(
                f"| {shape} | {name} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {r['fwdbwd_ms']:.3f} | "
                f"{r['fwdbwd_tflops']:.1f} | {r['fwd_ms'] / a['fwd_ms']:.2f} | {r['fwd_ms'] / b_['fwd_ms']:.2f} "
                f"| {r['fwdbwd_ms'] / a['fwdbwd_ms']:.2f} | {r['fwdbwd_ms'] / b_['fwdbwd_ms']:.2f} | {err} |"
            )
        d = rows["(d) fused triton"]
        vs_a, speedup = d["fwd_ms"] / a["fwd_ms"], b_["fwd_ms"] / d["fwd_ms"]
        verdicts.append(
            f"- {shape}: fused forward {vs_a:.2f}x ungated SDPA (target <= 1.05: "
            f"{'met' if vs_a <= 1.05 else 'missed'}); (b) / fused = {speedup:.2f} (target >= 1.2: "
            f"{'met' if speedup >= 1.2 else 'missed'})"
        )
    return "\n".join([*lines, "", *verdicts, ""])


def run(dry_run: bool, out: str) -> list[str]:
    """Benchmark, print the table and write it to ``out``; returns the shapes where the kernel is inaccurate."""
    if dry_run:
        device, dtype, shapes, compile_backend, measure = "cpu", torch.float32, DRY_SHAPES, "aot_eager", timer("cpu", 1)
        machine = "dry run: CPU, Triton interpreter (timings meaningless)"
    else:
        device, dtype, shapes, compile_backend, measure = "cuda", torch.bfloat16, SHAPES, "inductor", timer("cuda", 0)
        machine = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    import triton

    header = (
        f"# Gated attention: fused Triton kernel vs SDPA + gate\n\n{machine}; torch {torch.__version__}, "
        f"triton {triton.__version__}; {time.strftime('%Y-%m-%d')}; {str(dtype).removeprefix('torch.')}, "
        f"causal, elementwise gate; command: python benchmarks/gated_sdpa.py{' --dry-run' if dry_run else ''}"
    )
    results = {}
    for shape in shapes:
        results[shape] = bench_shape(shape, dtype, device, compile_backend, measure)
        print(f"done {shape}", flush=True)
    text = table(results, header)
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    problems = []
    for shape, rows in results.items():  # the kernel may not be fast and wrong: no worse than (b)'s own rounding
        err, floor = rows["(d) fused triton"]["max_err"], rows["(b) sdpa * gate"]["max_err"]
        if not err <= max(4 * floor, 1e-4):
            problems.append(f"fused kernel error {err:.2e} at {shape} exceeds 4x SDPA's own ({floor:.2e})")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, float32, tiny shapes")
    ap.add_argument("--out", default="results/bench/gated_sdpa.md")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run to exercise the script on a CPU")
    problems = run(args.dry_run, args.out)
    if problems:
        sys.exit("\n".join(problems))


if __name__ == "__main__":
    main()
