"""Peak memory of in-place quantization, and its calibration's time against the forward passes it runs.

    python benchmarks/inplace_memory.py                    # smollm2-135m and qwen3-0.6b shapes, fp32 and bf16,
                                                           # 128 and 512 tokens, four schemes (~15 min on 2 cores)
    python benchmarks/inplace_memory.py --models smollm2-135m --dtypes bfloat16 --schemes w8a8-int8-static
    git archive HEAD | tar -x -C /tmp/head && python benchmarks/inplace_memory.py --src /tmp/head   # another version

Every measurement runs in a fresh process, as benchmarks/scale.py's (whose random-init checkpoints and method
it reuses): the process loads the model, copies its weights out of the mapped file, runs a 16-token warm-up,
resets the kernel's peak-RSS counter (/proc/self/clear_refs) and runs ``qg.quantize(model, scheme,
calibration=[{"input_ids": ids}], inplace=True)`` on one sequence of random token ids. Columns:

* ``peak``: the peak resident memory above the process before the model existed, as a multiple of the model's
  bytes (scale.py's figure; the issue's goal is 1.1x);
* ``at start``: the same at the moment quantize starts: the model, the libraries the load and the warm-up
  paged in, the warm-up's heap; what quantize itself adds is ``peak`` minus this;
* ``calibration / forwards``: the time of quantize's calibration passes (``quantgate.quant._calibrate``,
  which runs each calibration batch through the model with the scheme's observers) over as many plain
  forward passes of the float model at the same length; ``-`` for a scheme that calibrates nothing
  (torchao's dynamic INT8);
* ``quantize / forward``: all of quantize (checks, fingerprint, calibration, weight quantization) over one
  plain forward.

The times come after the peak was read, in the same process: a fresh copy of the float model is loaded, its
forward timed three times, then quantized again with each calibration pass run three times; the fastest of
each is kept. They are CPU seconds (``time.process_time``) on ``--threads`` torch threads (1 unless set): on a
machine other processes share, wall-clock ratios of single runs were off by 2-10x, CPU time on one thread
repeats within a few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from observe_memory import kib  # a kB field of /proc/self/status
from scale import MODELS, _dtype, make

SCHEMES = ["w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "torchao-int8-dynamic"]


def measure(path: str, dtype: str, tokens: int, scheme: str, threads: int) -> dict:
    """In this process: the peak of quantizing the checkpoint at ``path`` in place, then the times (CPU seconds
    on ``threads`` threads)."""
    import gc

    import torch

    import quantgate as qg
    import quantgate.quant as quant
    from quantgate.models.families import config_of

    torch.manual_seed(0)

    def reset() -> int:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the peak RSS (VmHWM) back to the current RSS
        return kib("VmRSS")

    def loaded():
        model = qg.load(path, dtype=_dtype(dtype))
        for t in [*model.parameters(), *model.buffers()]:  # in the process's own memory, as scale.py has them
            t.data = t.data.clone()
        return model

    passes: list[list[float]] = []  # per calibration pass, the CPU seconds of each time it ran
    forwards: list[int] = []  # and the batches it ran
    calibrate = quant._calibrate
    repeats = 1  # 3 when timing: each calibration pass run three times

    def timed(model, batches, n, trim=False):
        batches, runs = list(batches), []
        for _ in range(repeats):
            t0 = time.process_time()
            seen = calibrate(model, batches, n, trim)
            runs.append(time.process_time() - t0)
        passes.append(runs)
        forwards.append(seen.batches)
        return seen

    quant._calibrate = timed
    base = reset()
    with torch.no_grad():
        model = loaded()
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ids = torch.randint(5, config_of(model).vocab_size, (1, tokens))
        model(ids[:, :16])  # builds lazy state
        start = reset()
        qg.quantize(model, scheme, calibration=[{"input_ids": ids}], inplace=True)
        peak = kib("VmHWM")
        del model
        gc.collect()
        torch.set_num_threads(threads)  # the times: plain forwards of the float model, then quantize again
        model = loaded()
        model(ids[:, :16])
        forward = []
        for _ in range(3):
            t0 = time.process_time()
            model(ids)
            forward.append(time.process_time() - t0)
        passes.clear()
        forwards.clear()
        repeats = 3
        t0 = time.process_time()
        qg.quantize(model, scheme, calibration=[{"input_ids": ids}], inplace=True)
        seconds = time.process_time() - t0 - sum(sum(runs[1:]) for runs in passes)  # with each pass run once
    return {
        "model_bytes": model_bytes,
        "peak": (peak - base) * 1024,
        "start": (start - base) * 1024,
        "s": seconds,
        "calibration_s": sum(min(runs) for runs in passes),
        "forwards": sum(forwards),
        "forward_s": min(forward),
        "threads": threads,
    }


def run_child(path: Path, dtype: str, tokens: int, scheme: str, threads: int, src: str | None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", str(path), dtype, str(tokens), scheme, str(threads)]
    env = dict(os.environ)
    if src:  # another version of quantgate first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(f"  {scheme} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(name: str, dtype: str, tokens: int, scheme: str, x: dict | None) -> str:
    if x is None:
        return f"| {name} | {dtype} | {tokens} | {scheme} | failed | | | |"
    mb = x["model_bytes"]
    calib = f"{x['calibration_s'] / (x['forwards'] * x['forward_s']):.2f}x" if x["forwards"] else "-"
    return (
        f"| {name} | {dtype} | {tokens} | {scheme} | {x['peak'] / mb:.2f}x | {x['start'] / mb:.2f}x | {calib} "
        f"| {x['s'] / x['forward_s']:.2f}x |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-0.6b"], choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--schemes", nargs="+", default=SCHEMES)
    ap.add_argument("--work", help="where the random-init checkpoints go (default: a temporary folder)")
    ap.add_argument("--src", help="a folder with another version of the quantgate package, measured instead")
    ap.add_argument("--json", help="also write the measurements to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the times (the peak: torch's default)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        path, dtype, tokens, scheme, threads = args.child
        print(json.dumps(measure(path, dtype, int(tokens), scheme, int(threads))))
        return
    t0 = time.perf_counter()
    lines = [
        "| model | dtype | tokens | scheme | peak | at start | calibration / forwards | quantize / forward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        for name in args.models:
            for dtype in args.dtypes:
                path = make(name, dtype, root, MODELS)
                for tokens in args.tokens:
                    for scheme in args.schemes:
                        x = run_child(path, dtype, tokens, scheme, args.threads, args.src)
                        lines.append(row(name, dtype, tokens, scheme, x))
                        print(lines[-1], file=sys.stderr, flush=True)
                        found.append({"model": name, "dtype": dtype, "tokens": tokens, "scheme": scheme, **(x or {})})
    print(
        f"quantgate from {args.src or 'this checkout'}; times in CPU seconds on {args.threads} thread(s); "
        f"{(time.perf_counter() - t0) / 60:.0f} min\n"
    )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
