"""Memory and time of quantgate's steps by model size, measured here, with a fitted model and its extrapolation.

    python benchmarks/scale.py                          # smollm2-135m, qwen3-0.6b, qwen3-1.7b shapes; fp32 and bf16
    python benchmarks/scale.py --models smollm2-135m --dtypes bfloat16 --tokens 256
    python benchmarks/scale.py --dry-run --out /tmp/s   # a minute: two tiny models, three steps (a slow test)

results/bench/scale-cpu.md came from three measuring runs into one --work folder, then the report of all of them
(STEPS="load forward eval observe" plus static INT8 and torchao's INT8 quantization, copy and in place; about
45 min on 2 cores; the simulated dynamic INT8 and FP8 schemes measured within 0.1x of static INT8 in a first run):

    python benchmarks/scale.py --work W --models smollm2-135m qwen3-0.6b --steps $STEPS
    python benchmarks/scale.py --work W --models qwen3-1.7b --dtypes bfloat16 --steps $STEPS
    python benchmarks/scale.py --work W --models qwen3-1.7b --dtypes float32 --steps $STEPS
    python benchmarks/scale.py --work W --report-only --steps $STEPS

Random-init models of published shapes (weights do not change memory or time): SmolLM2-135M, Qwen3-0.6B and
Qwen3-1.7B (Qwen3-0.6B's preset at hidden 2048, FFN 6144, 28 layers: 1.72 B parameters). Each is saved once as
a quantgate checkpoint in its dtype; every measurement then runs in a fresh process that loads it, resets the
kernel's peak-RSS counter (/proc/self/clear_refs) and runs one step on one sequence of random token ids:

* ``load``: ``qg.load(dir, dtype=...)`` and a read of every weight (safetensors maps the file: a weight is
  resident once read);
* ``forward``: ``model(ids)`` with the logits, no gradients: the baseline every time is divided by;
  this and the steps below first copy the weights out of the mapped checkpoint into the process's memory, as
  loading onto a GPU does: a mapped file's pages that quantization has replaced stay resident (as reclaimable
  page cache, counted in RSS), which made in-place quantization read 2x here before;
* ``eval``: what an lm-eval perplexity request costs: the forward, then log-softmax over the vocabulary in
  float32 and the targets' log-probabilities (lm-eval's HFLM scoring);
* ``observe``: ``qg.observe`` (per-layer statistics, sink mass) on the sequence;
* ``quantize SCHEME copy|inplace``: ``qg.quantize`` calibrated on the sequence, as a copy or in place, for one
  scheme per family: static INT8 (simulated, calibrated ranges), dynamic INT8 (simulated, per-token), FP8 E4M3
  (simulated) and torchao's INT8 dynamic (real int8 weights); its time includes the calibration forward.

Peak memory is reported as a multiple of the model's bytes (parameters x bytes per parameter): the peak resident
memory of the step above the process's memory before the model existed. Time as the step's seconds over the
forward's at the same tokens (a ratio measured in the same run), and tokens per second. Every step runs at two
lengths (``--tokens``), and a least-squares fit per step and dtype gives bytes = a x model bytes + b x tokens.
The report extrapolates the fit to 8 B and 70 B models on H200s (141 GB each): marked as an extrapolation, since
a GPU's allocator, kernels and the activations of a 8k-wide model are not what this CPU measured.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from observe_memory import kib  # a kB field of /proc/self/status

MODELS = {  # name: (preset, config overrides)
    "smollm2-135m": ("smollm2-135m", {}),
    "qwen3-0.6b": ("qwen3-0.6b", {}),
    "qwen3-1.7b": ("qwen3-0.6b", {"hidden_size": 2048, "intermediate_size": 6144}),
}
DRY_MODELS: dict[str, tuple[str, dict[str, int]]] = {"tiny-llama": ("tiny-llama", {}), "tiny-qwen3": ("tiny-qwen3", {})}
SCHEMES = ["w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "torchao-int8-dynamic"]
STEPS = ["load", "forward", "eval", "observe"] + [f"quantize {s} {how}" for s in SCHEMES for how in ("copy", "inplace")]
H200_GB = 141
TARGETS = {"8B": 8.0e9, "70B": 70.6e9}  # parameters (Llama-3.1-8B: 8.03 B; Llama-3.1-70B: 70.6 B)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def make(name: str, dtype: str, root: Path, models: dict) -> Path:
    """The random-init checkpoint of ``name`` in ``dtype`` under ``root`` (saved once)."""
    import torch

    import quantgate as qg
    from quantgate.models import build

    path = root / f"{name}-{dtype}"
    if not (path / "config.json").is_file():
        preset, overrides = models[name]
        with torch.device("cpu"):
            model = build(preset, dtype=_dtype(dtype), **overrides)
        qg.save(model, path)
    return path


def measure(step: str, path: str, dtype: str, tokens: int) -> dict:
    """Peak RSS above the process's model-less baseline (bytes) and seconds of one step (in this process)."""
    import torch

    import quantgate as qg
    from quantgate.models.families import config_of

    torch.manual_seed(0)

    def reset() -> int:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the peak RSS (VmHWM) back to the current RSS
        return kib("VmRSS")

    base = reset()
    t0 = time.perf_counter()
    model = qg.load(path, dtype=_dtype(dtype))
    for p in model.parameters():  # page the weights in: safetensors maps them, resident only once read
        p.sum()
    loaded_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(5, config_of(model).vocab_size, (1, tokens))
    out = {"params": params, "model_bytes": model_bytes}
    if step == "load":
        return {**out, "peak": (kib("VmHWM") - base) * 1024, "s": loaded_s}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:  # in memory of the process's own, as on an accelerator:
            t.data = t.data.clone()  # a mapped file's pages would stay resident after quantization replaced them
        model(ids[:, :16])  # builds lazy state
        reset()
        t0 = time.perf_counter()
        if step == "forward":
            model(ids)
        elif step == "eval":
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            logp.gather(-1, ids[0, 1:, None]).sum()
        elif step == "observe":
            qg.observe(model, [{"input_ids": ids}], progress=False)
        else:
            _, scheme, how = step.split()
            qg.quantize(model, scheme, calibration=[{"input_ids": ids}], inplace=how == "inplace")
        seconds = time.perf_counter() - t0
    return {**out, "peak": (kib("VmHWM") - base) * 1024, "s": seconds}


def run_child(step: str, path: Path, dtype: str, tokens: int, cache: Path) -> dict | None:
    """One measurement in a fresh process, kept in ``cache`` (a JSON file): a later run reads it back."""
    if cache.is_file():
        return json.loads(cache.read_text())
    cmd = [sys.executable, __file__, "--child", step, str(path), dtype, str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(f"  {step} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    cache.write_text(done.stdout.strip().splitlines()[-1])
    return json.loads(cache.read_text())


def cached(root: Path, name: str, dtype: str, tokens: int, step: str) -> Path:
    return root / "measured" / f"{name}-{dtype}-{tokens}-{step.replace(' ', '_')}.json"


def fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares of peak = a x model_bytes + b x tokens over (model_bytes, tokens, peak); (a, b, worst
    relative residual)."""
    sxx = sum(m * m for m, _, _ in points)
    sxy = sum(m * t for m, t, _ in points)
    syy = sum(t * t for _, t, _ in points)
    sxz = sum(m * p for m, _, p in points)
    syz = sum(t * p for _, t, p in points)
    det = sxx * syy - sxy * sxy
    a = (sxz * syy - syz * sxy) / det
    b = (sxx * syz - sxy * sxz) / det
    worst = max(abs(a * m + b * t - p) / p for m, t, p in points)
    return a, b, worst


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}" if x < 1e11 else f"{x / 1e9:,.0f}"


def report(rows: dict, dtypes: list[str], tokens: list[int], models: list[str], steps: list[str], wall: float) -> str:
    lines = [
        "# quantgate's steps by model size (CPU, measured) and an extrapolation to 8B and 70B",
        "",
        f"Command: `{' '.join(['python', 'benchmarks/scale.py', *sys.argv[1:]])}` ({wall / 60:.0f} min wall). "
        f"Machine: {_machine()}. Random-init models; one sequence of random token ids per step; each step in a "
        "fresh process. Peak: resident memory above the process before the model existed, as a multiple of the "
        "model's bytes. Time: the step over a plain forward at the same tokens (measured in the same run).",
        "",
    ]
    for dtype in dtypes:
        lines += [
            f"## {dtype}",
            "",
            "| model | params | model GB | tokens | " + " | ".join(steps) + " |",
            "|---|---|---|---|" + "---|" * len(steps),
        ]
        for name in models:
            for n in tokens:
                r = {s: rows.get((name, dtype, n, s)) for s in steps}
                ref = next((x for x in r.values() if x), None)
                if ref is None:
                    continue
                fwd = r["forward"]
                cells = []
                for s in steps:
                    x = r[s]
                    if x is None:
                        cells.append("failed")
                        continue
                    mem = f"{x['peak'] / x['model_bytes']:.2f}x"
                    if s == "load" or fwd is None:
                        cells.append(f"{mem}, {x['s']:.1f} s")
                    else:
                        cells.append(f"{mem}, {x['s'] / fwd['s']:.2f}x time")
                lines.append(
                    f"| {name} | {ref['params'] / 1e9:.3f} B | {ref['model_bytes'] / 1e9:.2f} | {n} | "
                    + " | ".join(cells)
                    + " |"
                )
        lines.append("")
        fwd_rates = [
            (name, n, rows[(name, dtype, n, "forward")])
            for name in models
            for n in tokens
            if rows.get((name, dtype, n, "forward"))
        ]
        lines.append(
            "Forward throughput: "
            + "; ".join(f"{name} at {n} tokens {n / x['s']:,.0f} tokens/s" for name, n, x in fwd_rates)
            + "."
        )
        lines.append("")
    lines += [
        "## The fit: peak bytes = a x model bytes + b x tokens",
        "",
        "| dtype | step | a | b (MB per 1k tokens) | worst residual |",
        "|---|---|---|---|---|",
    ]
    fits: dict[tuple[str, str], tuple[float, float]] = {}
    for dtype in dtypes:
        for s in steps:
            pts = [
                (x["model_bytes"], n, x["peak"])
                for name in models
                for n in tokens
                if (x := rows.get((name, dtype, n, s)))
            ]
            if len(pts) >= 3 and len({p[1] for p in pts}) > 1 and len({p[0] for p in pts}) > 1:
                a, b, worst = fit(pts)
                fits[dtype, s] = (a, b)
                lines.append(f"| {dtype} | {s} | {a:.2f} | {b * 1024 / 1e6:.2f} | {worst:.0%} |")
    lines += [
        "",
        "b is fitted across models of different width and vocabulary; per-token activations grow with both "
        "(eval's float32 log-softmax over the vocabulary most), so b holds for models like these, and the a x "
        "model bytes term carries the extrapolation. Quantization reads its calibration tokens once: its b is "
        "noise (negative where the fit says so). In place, its peak above the model is set by the float32 "
        "temporaries of the largest single tensor (the quantizer's arithmetic is float32 whatever the model's "
        "dtype; in bf16 that doubles them), which is the embedding table here (23-26% of these models, 6% of "
        "an 8B Llama): a at 8B and 70B is an upper bound for in-place quantization.",
        "",
    ]
    lines += _extrapolation(fits)
    return "\n".join(lines) + "\n"


def _extrapolation(fits: dict[tuple[str, str], tuple[float, float]]) -> list[str]:
    """What the fit predicts for 8B and 70B in bf16 on H200s: an extrapolation, marked as one."""
    if not any(d == "bfloat16" for d, _ in fits):
        return []
    lines = [
        "## Extrapolation (not measured): bf16 on H200 GPUs (141 GB each), 8 x 2048 tokens per step",
        "",
        "| model | step | predicted peak GB | H200s | with |",
        "|---|---|---|---|---|",
    ]
    tokens = 8 * 2048

    def need(a: float, b: float, model_bytes: float) -> tuple[float, int]:
        peak = a * model_bytes + max(b, 0.0) * tokens
        return peak, max(1, math.ceil(peak / (H200_GB * 1e9 * 0.9)))  # 10% for the CUDA context, fragmentation

    for label, params in TARGETS.items():
        model_bytes = 2 * params
        for (dtype, s), (a, b) in fits.items():
            if dtype != "bfloat16" or (s.startswith("quantize") and "torchao" in s):
                continue
            peak, gpus = need(a, b, model_bytes)
            how = "one GPU" if gpus == 1 else f"--device-map auto over {gpus} GPUs (or accelerate's max_memory)"
            if s.endswith("copy") and (dtype, s.replace("copy", "inplace")) in fits:
                fewer = need(*fits[dtype, s.replace("copy", "inplace")], model_bytes)[1]
                how += f"; in place (--inplace): {fewer}" if fewer < gpus else ""
            lines.append(f"| {label} | {s} | {_gb(peak)} | {gpus} | {how} |")
    return [*lines, ""]


def _machine() -> str:
    import os
    import platform

    import torch

    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads), "
        f"{kib('MemTotal', '/proc/meminfo') / 2**20:.0f} GiB, torch {torch.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, *DRY_MODELS])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512], help="sequence lengths (two for the fit)")
    ap.add_argument("--steps", nargs="+", default=STEPS, help="a subset of the steps")
    ap.add_argument("--dry-run", action="store_true", help="tiny models, short sequences: seconds")
    ap.add_argument("--work", help="where the random-init checkpoints go (default: a temporary folder)")
    ap.add_argument("--out", default="results/bench", help="folder for scale-cpu.md and scale.json")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="the report from what earlier runs measured into --work (one run per model if need be)",
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        step, path, dtype, tokens = args.child
        print(json.dumps(measure(step, path, dtype, int(tokens))))
        return
    if unknown := [s for s in args.steps if s not in STEPS]:
        ap.error(f"unknown step(s) {', '.join(unknown)}; valid: {', '.join(STEPS)}")
    models = {**MODELS, **DRY_MODELS}
    if args.dry_run:  # every kind of step once, on two tiny models: the code path, not the numbers
        args.models, args.dtypes, args.tokens = list(DRY_MODELS), ["bfloat16"], [32, 64]
        args.steps = ["load", "forward", "quantize w8a8-int8-static inplace"]
    t0 = time.perf_counter()
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        (root / "measured").mkdir(parents=True, exist_ok=True)
        for name in args.models:
            for dtype in args.dtypes:
                keys = [(n, step) for n in args.tokens for step in args.steps]
                if args.report_only:  # what earlier runs measured into --work, nothing new
                    for n, step in keys:
                        if (c := cached(root, name, dtype, n, step)).is_file():
                            rows[name, dtype, n, step] = json.loads(c.read_text())
                    continue
                path = make(name, dtype, root, models)
                for n, step in keys:
                    x = rows[name, dtype, n, step] = run_child(step, path, dtype, n, cached(root, name, dtype, n, step))
                    shown = f"{x['peak'] / x['model_bytes']:.2f}x model, {x['s']:.2f} s" if x else "failed"
                    print(f"{name} {dtype} {n} tokens, {step}: {shown}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-dry-run" if args.dry_run else ""
    text = report(rows, args.dtypes, args.tokens, args.models, args.steps, time.perf_counter() - t0)
    if args.dry_run:
        text = text.replace(
            "\n\n",
            "\n\nDry run: models of a few MB, which the process's own allocations dwarf; "
            "these numbers test the code path, not the memory model.\n\n",
            1,
        )
    (out / f"scale-cpu{suffix}.md").write_text(text)
    (out / f"scale{suffix}.json").write_text(
        json.dumps(
            [
                {"model": k[0], "dtype": k[1], "tokens": k[2], "step": k[3], **(v or {"failed": True})}
                for k, v in rows.items()
            ],
            indent=1,
        )
    )
    print(text)
    print(f"wrote {out / f'scale-cpu{suffix}.md'}")


if __name__ == "__main__":
    main()
