"""One command for a GPU machine: versions, the attention tests, the Triton kernel against the eager
reference, a few training steps on both backends, the gated-SDPA benchmark table, a device_map-sharded
evaluation, a 2-cell study on Ray with one GPU per cell, FSDP training resumed bit for bit, and what observing and
simulated quantization cost against a forward on the device (issue 55's ratios).

    PYTHONPATH=. python benchmarks/gpu_check.py                 # CUDA: fp32, bf16, fp16; under 9 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run       # CPU, Triton interpreter, fp32, tiny shapes (CI)

Each section runs on its own: a failure is printed with its traceback and the next section runs; a
section that needs a library the machine lacks (or has too old) is skipped with a message. Writes
``<out>/gated_sdpa-<gpu>.md`` (the benchmark table) and ``<out>/gpu_check-<gpu>.json`` (every number
printed), then a PASS/FAIL/SKIP summary; exits 1 if any section failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, cast

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; the interpreter's bf16/fp8 are wrong: fp32 only

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 540  # all sections together stay under 9 minutes
LIMITS_S = {
    "versions": 30,
    "tests": 120,
    "kernel": 150,
    "training": 90,
    "benchmark": 240,
    "sharded": 60,
    "ray_study": 120,
    "fsdp": 90,
    "quant_speed": 90,
}
TESTS = ["tests/test_sdpa.py", "tests/test_triton.py"]  # gated_sdpa's backends (the fused kernel on the interpreter)
# name: (B, Hq, Hkv, causal, gate, learned sinks, padded keys)
CASES = {
    "mha-causal-elementwise": (1, 2, 2, True, "elementwise", False, False),
    "gqa-causal-headwise-sinks": (1, 4, 2, True, "headwise", True, False),
    "mqa-padded-causal-elementwise-sinks": (2, 2, 1, True, "elementwise", True, True),
    "padded-bidirectional-ungated": (2, 1, 1, False, None, False, True),
}


class Skip(Exception):
    """The section cannot run on this machine; the message says why."""


def versions(args, rec):
    """The libraries and the device found."""
    found = {p: _version(p) for p in ("torch", "triton", "transformers", "lm_eval", "torchao", "bitsandbytes")}
    found |= {
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)",
    }
    if args.device == "cuda":
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for key, value in found.items():
        print(f"  {key:<13} {value or 'not installed'}")
    rec["versions"] = found
    return True


def tests(args, rec):
    """pytest on the attention tests, in a subprocess."""
    if args.dry_run:
        raise Skip("dry run: the test suite runs these tests itself")
    if _version("pytest") is None:
        raise Skip("pytest is not installed")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print("\n".join(run.stdout.strip().splitlines()[-15:]))
    rec["tests"] = run.stdout.strip().splitlines()[-1:]
    return run.returncode == 0


def kernel(args, rec):
    """The fused kernel against the eager reference: output and sink mass, then the gradients of every input.
    The reference runs in float32 on the same (rounded) inputs; a low-precision kernel passes when its error is
    within 4x eager attention's own error in that dtype."""
    import triton  # noqa: F401  (Skip where it is missing)

    from quantgate.attention import gated_sdpa

    n, d = (20, 16) if args.dry_run else (1000, 128)
    ok, rec["kernel"] = True, {}
    for name, (b, hq, hkv, causal, gate, sinks, padded) in CASES.items():
        g = torch.Generator(args.device).manual_seed(0)
        rand = lambda *s, g=g: torch.randn(*s, generator=g, device=args.device)
        raw = {"q": rand(b, hq, n, d), "k": rand(b, hkv, n, d), "v": rand(b, hkv, n, d)}
        if gate:
            raw["gate"] = torch.sigmoid(rand(b, hq, n, d if gate == "elementwise" else 1))
        if sinks:
            raw["sinks"] = rand(hq)
        mask = None
        if padded:  # row 0 left-padded (causal rows that see no key), row 1 right-padded
            mask = torch.ones(b, n, dtype=torch.bool, device=args.device)
            mask[0, :3], mask[1, -7:] = False, False
            mask = mask[:, None, None, :]
        probe = rand(b, hq, n, d)

        def run(backend, inputs, mask=mask, causal=causal, probe=probe):
            leaves = {k: t.detach().clone().requires_grad_() for k, t in inputs.items()}
            out, mass = gated_sdpa(
                leaves["q"],
                leaves["k"],
                leaves["v"],
                leaves.get("gate"),
                attn_mask=mask,
                is_causal=causal,
                sinks=leaves.get("sinks"),
                backend=backend,
                sink_tokens=1,
            )
            grads = torch.autograd.grad((out.float() * probe).sum(), list(leaves.values()))
            return {"fwd": [out, mass], "bwd": list(grads)}

        for dtype in args.dtypes:
            low = {k: t.to(dtype) for k, t in raw.items()}
            ref = run("eager", {k: t.float() for k, t in low.items()})
            err = {
                backend: {
                    part: max(_abs_max(a.float() - r) for a, r in zip(res[part], ref[part], strict=True))
                    for part in ref
                }
                for backend, res in (("triton", run("triton", low)), ("eager", run("eager", low)))
            }
            floor = {part: 1e-4 * max(1.0, *map(_abs_max, ref[part])) for part in ref}
            good = all(err["triton"][p] <= max(4 * err["eager"][p], floor[p]) for p in ref)
            ok &= good
            key = f"{name}/{str(dtype).removeprefix('torch.')}"
            rec["kernel"][key] = err["triton"] | {"eager_" + p: e for p, e in err["eager"].items()}
            print(
                f"  {key:<45} max abs err fwd {err['triton']['fwd']:.2e} bwd {err['triton']['bwd']:.2e}   "
                f"(eager in this dtype: {err['eager']['fwd']:.2e} / {err['eager']['bwd']:.2e})  "
                f"{'ok' if good else 'TOO LARGE'}"
            )
    return ok


def training(args, rec):
    """A few AdamW steps of a small gated Llama on a padded batch, backend "sdpa" vs "triton" (float32)."""
    import quantgate as qg

    shape: dict[str, Any]  # config overrides of the preset
    preset, shape, batch, seq, steps, tol = (
        ("tiny-llama", {"num_hidden_layers": 1}, 1, 16, 2, 1e-4)
        if args.dry_run
        else ("small-llama", {}, 8, 256, 10, 1e-3)
    )
    ids = torch.randint(5, 8000, (batch, seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    attn = torch.ones_like(ids)
    attn[-1, seq // 2 :] = 0
    losses: dict[str, list[float]] = {}
    for backend in ("sdpa", "triton"):
        model = qg.build(preset, "g1-elementwise", backend=backend, seed=0, **shape).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[backend] = []
        for _ in range(steps):
            loss = model(ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[backend].append(loss.item())
    diff = [abs(a - b) for a, b in zip(losses["sdpa"], losses["triton"], strict=True)]
    print(f"  {preset}, g1-elementwise, batch {batch} x {seq}\n  step  sdpa        triton      |diff|")
    for i, (a, b, e) in enumerate(zip(losses["sdpa"], losses["triton"], diff, strict=True)):
        print(f"  {i:>4}  {a:.6f}  {b:.6f}  {e:.1e}")
    rec["training"] = losses | {"max_diff": max(diff)}
    return max(diff) <= tol and losses["sdpa"][-1] < losses["sdpa"][0]


def benchmark(args, rec):
    """benchmarks/gated_sdpa.py, its table written beside this script's JSON."""
    import gated_sdpa  # benchmarks/ is this script's folder, hence on sys.path

    out = Path(args.out) / f"gated_sdpa-{args.slug}.md"
    problems = gated_sdpa.run(args.dry_run, str(out))
    print(*problems, f"  wrote {out}", sep="\n")
    rec["benchmark"] = {"table": str(out), "problems": problems}
    return not problems


def sharded(args, rec):
    """A checkpoint loaded with a device_map split (GPU and CPU; CPU and disk in the dry run) against it whole."""
    import tempfile

    import quantgate as qg
    from quantgate.models.io import Placement

    with tempfile.TemporaryDirectory() as tmp:
        qg.save(qg.build("tiny-llama", seed=0), f"{tmp}/ckpt")
        first = "cpu" if args.dry_run else 0
        split = {
            "model.embed_tokens": first,
            "model.rotary_emb": first,
            "model.layers.0": first,
            "model.layers.1": "disk" if args.dry_run else "cpu",
            "model.norm": "cpu",
            "lm_head": "cpu",
        }
        whole = qg.load(f"{tmp}/ckpt").to(args.device)
        placed = qg.load(f"{tmp}/ckpt", placement=Placement(split, offload_folder=f"{tmp}/offload"))
        ids = torch.randint(5, 8000, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = _abs_max(whole(ids.to(args.device)).logits.cpu() - placed(ids.to(args.device)).logits.cpu())
            loss = [m(ids.to(args.device), labels=ids.to(args.device)).loss.item() for m in (whole, placed)]
    print(
        f"  split {sorted(set(map(str, split.values())))}: max |logit difference| {diff:.2e}; "
        f"perplexity {math.exp(loss[0]):.6f} whole, {math.exp(loss[1]):.6f} placed"
    )
    rec["sharded"] = {"max_logit_diff": diff, "perplexity": [math.exp(x) for x in loss]}
    return diff <= 1e-4 and math.isclose(loss[0], loss[1], rel_tol=1e-5)


def ray_study(args, rec):
    """A 2-cell study on Ray, one GPU per cell, against the same study run serially."""
    if args.dry_run:
        raise Skip("the dry run leaves Ray to tests/test_ray_executor.py (a local Ray on the CPU)")
    import tempfile

    import ray  # noqa: F401  (an ImportError skips the section)

    from quantgate.study import read_metrics, run_study

    data = "{data: backcopy, batches: 1, seq_len: 64, batch_size: 2}"  # backcopy: scored without lm-eval
    study = (
        "name: gpu-ray\nseed: 0\nmodels:\n  - name: tiny\n    preset: tiny-llama\n"
        "    variants: [vanilla, g1-headwise]\n"
        "    resources: {gpus: 1, cpus: 1}\n    train: {data: backcopy, steps: 50, batch_size: 4, seq_len: 64, "
        f"eval_every: 0, observe_every: 0}}\nschemes: [w8a8-int8-dynamic]\ncalibration: {data}\nobserve: {data}\n"
        "eval: {tasks: [quantgate_backcopy], limit: {quantgate_backcopy: 4}}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/s.yaml").write_text(study)
        runs = {ex: read_metrics(run_study(f"{tmp}/s.yaml", Path(tmp) / ex, executor=ex)) for ex in ("serial", "ray")}
    ppl = {ex: [c.float_results["quantgate_backcopy"]["perplexity"] for c in r.cells] for ex, r in runs.items()}
    print(f"  perplexity per cell: serial {ppl['serial']}, ray {ppl['ray']}")
    rec["ray_study"] = ppl
    return all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(ppl["serial"], ppl["ray"], strict=True))


def fsdp(args, rec):
    """FSDP version 2 training under accelerate's FSDP config: 8 steps straight against 4, stop, resume, 4."""
    if args.dry_run:
        raise Skip("the dry run leaves FSDP to tests/test_train.py (2 gloo processes on the CPU)")
    import tempfile

    from safetensors.torch import load_file

    config = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    }  # what accelerate launch --use_fsdp exports
    diffs = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "1",
                str(ROOT / "tests/_fsdp_train.py"),
                tmp,
            ],
            check=True,
            env={**os.environ, **config},
            cwd=ROOT,
        )
        for name in (
            "model/model.quantgate.safetensors",  # g1-headwise: qg.save names a gated model's weights so
            "checkpoints/step-8/model.safetensors",
            "checkpoints/step-8/optimizer.safetensors",
        ):
            a, b = load_file(f"{tmp}/straight/{name}"), load_file(f"{tmp}/resumed/{name}")
            diffs[name] = max(_abs_max(a[k].double() - b[k].double()) for k in a) if a.keys() == b.keys() else math.inf
    print("\n".join(f"  {name}: max |straight - resumed| {d:.1e}" for name, d in diffs.items()))
    rec["fsdp"] = diffs
    return all(d == 0 for d in diffs.values())


def quant_speed(args, rec):
    """observe / forward and simulated schemes / float forward on the device (issue 55's ratios)."""
    from roundrobin import ratio, round_robin  # benchmarks/ is this script's folder, hence on sys.path

    import quantgate as qg
    from quantgate.models import build
    from quantgate.models.families import config_of

    name, tokens, dtype = ("tiny-llama", 32, torch.float32) if args.dry_run else ("smollm2-135m", 512, torch.bfloat16)
    torch.manual_seed(0)
    model = build(name, dtype=dtype).to(args.device).eval()
    vocab = config_of(model).vocab_size
    ids = torch.randint(5, vocab, (1, tokens), device=args.device)
    calib = [{"input_ids": torch.randint(5, vocab, (1, tokens), device=args.device)} for _ in range(2)]
    schemes = ["w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "w4a4-mxfp4", "w4a4-nvfp4"]
    models: dict[str, torch.nn.Module] = {"float": model}
    for scheme in schemes:  # (NVFP4 reads the calibration batches for its export scale, and says it read 2)
        options: dict[str, Any] = {"calib": 2} if qg.quant.get_scheme(scheme).needs_calibration else {}
        models[scheme] = qg.quantize(model, scheme, calibration=calib, **options)

    def timed(fn):
        def call(i):
            with torch.no_grad():
                fn()
            if args.device == "cuda":
                torch.cuda.synchronize()

        return call

    sides = {k: timed(lambda m=m: m(input_ids=ids)) for k, m in models.items()}
    base = cast(torch.nn.Module, model.base_model)
    sides["forward"] = timed(lambda: base(input_ids=ids))
    sides["observe"] = timed(lambda: qg.observe(model, [{"input_ids": ids}], progress=False))
    times = round_robin(sides, 3 if args.dry_run else 10)
    rows = {"observe / forward": ratio(times, "observe", "forward")}
    rows |= {f"{scheme} / float": ratio(times, scheme, "float") for scheme in schemes}
    print(f"  {name}, {dtype}, 1 x {tokens} tokens on {args.device}:")
    print("\n".join(f"  {k}: {v}" for k, v in rows.items()))
    rec["quant_speed"] = {"model": name, "dtype": str(dtype), "tokens": tokens, "ratios": rows}
    return True


def _abs_max(t: torch.Tensor) -> float:
    return t.abs().max().item()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _timeout(signum, frame):
    raise TimeoutError("the section ran past its time limit")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, float32, tiny shapes")
    ap.add_argument("--out", default="results/bench", help="folder for the table and the JSON")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run to exercise the script on a CPU")
    args.device = "cpu" if args.dry_run else "cuda"
    args.dtypes = [torch.float32] if args.dry_run else [torch.float32, torch.bfloat16, torch.float16]
    args.slug = "cpu-dry-run" if args.dry_run else re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower())
    signal.signal(signal.SIGALRM, _timeout)
    rec: dict[str, Any] = {}
    status: dict[str, str] = {}
    deadline = time.monotonic() + BUDGET_S
    for section in (versions, tests, kernel, training, benchmark, sharded, ray_study, fsdp, quant_speed):
        name, t0 = section.__name__, time.monotonic()
        assert section.__doc__ is not None  # each section says what it checks
        print(f"\n== {name}: {section.__doc__.splitlines()[0]}", flush=True)
        signal.alarm(max(1, int(min(LIMITS_S[name], deadline - t0))))
        try:
            status[name] = "PASS" if section(args, rec) else "FAIL"
        except (Skip, ImportError) as e:  # ImportError: a library missing, or older than the section needs
            status[name] = "SKIP"
            print(f"  skipped: {e}")
        except Exception:
            status[name] = "FAIL"
            traceback.print_exc()
        finally:
            signal.alarm(0)
        print(f"  {status[name]} ({time.monotonic() - t0:.1f} s)", flush=True)
    rec["status"] = status
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"gpu_check-{args.slug}.json").write_text(json.dumps(rec, indent=1))
    print("\n== summary\n" + "\n".join(f"  {name:<10} {s}" for name, s in status.items()))
    return 1 if "FAIL" in status.values() else 0


if __name__ == "__main__":
    sys.exit(main())
