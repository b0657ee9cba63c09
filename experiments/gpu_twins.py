"""A twin pair trained on a GPU: does the G1 gate keep a 6-layer d=512 Llama quantizable at INT8?

    PYTHONPATH=. python experiments/gpu_twins.py                       # CUDA (an H200): --budget-s 540 s in all
    PYTHONPATH=. python experiments/gpu_twins.py --dry-run --out DIR   # CPU, tiny config, ~40 s (CI; --smoke too)

Two Llama-style models from one preset and config (``small-llama`` widened to d = 512, 6 layers, 8 heads
of 64, FFN 1536, 8,192-token BPE vocabulary, tied embeddings: 25 M parameters), the same data (the bundled
``train`` split, 3.1 M tokens, 16 x 1,024-token rows a step, each opening with BOS, reshuffled each epoch), steps,
learning rate (1e-3, cosine after 5% warm-up, AdamW 0.9 / 0.95, weight decay 0.1, none on norm gains or biases)
and seed: one ungated (``vanilla``), one with Qiu et al.'s G1 elementwise gate (``g1-elementwise``). Those
settings are where the literature sees outliers emerge (a first token every row attends to, long rows, norm gains
free to grow); outliers and first-token attention are logged every 250 steps (``LOG_EVERY``).

Manipulation check, declared before any run (issue 56): the ungated twin must reach max / median >= 500 and a
static W8A8 change whose interval lies at or above +10%. Where it does not, the report says "no test" for every
scheme: a pair whose ungated member does not break cannot show what the gate fixes, and is no evidence of "no gate
effect". bf16 mixed precision (fp32 weights); the
gated SDPA runs on quantgate's Triton kernel where CUDA has it (backend ``auto``). Then, for each model:
observe (max |x| of the residual stream, max / median, first-token attention, per layer; validation text),
quantize (``w8a8-int8-static``, ``w8a8-int8-bondarenko``: 16 calibration batches of 8 x 512 train tokens,
the same for both; ``w8a8-int8-dynamic``: none) and evaluate the float model and each scheme on the held-out
documents of ``quantgate_ppl`` (``--limit`` 24: the bundled test split's documents taken in turn from each of
its 9 works, 101 k tokens). Each change of perplexity has its paired 95% interval over documents
(``quantgate.stats.paired_delta``), and for each scheme the gated-minus-ungated difference of the two changes has
its own paired interval over the same documents: ``quantgate.stats.paired_difference`` where the installed
quantgate has it, else a jackknife t-interval over documents computed here (the report names which).

Perplexity without lm-eval: the device has no lm-eval (nor torchao, bitsandbytes, a package registry), so
the script scores the documents itself, with lm-eval's ``loglikelihood_rolling`` windows (``max_length`` =
the training length, BOS before the first window, disjoint scored spans: :func:`ppl_documents`) and the
columns ``qg.evaluate`` returns for ``quantgate_ppl`` (``loglikelihood``, ``tokens``, ``words``, ``bytes``;
tests/test_gpu_twins.py checks they equal ``qg.evaluate``'s where lm-eval is installed). CPU and GPU run this
one path; the dry run differs in sizes only (``tiny-llama``, 32-token rows, a few steps, 2 documents).

Steps (``--steps``, default ``auto``): the CUDA run times 20 steps of a throwaway copy of the gated model (the
slower twin) and gives each twin ``(budget - time so far - 75 s kept for observe, quantize and evaluate) / 2``
of training, at least 200 steps. The estimate behind the default budget: at about 400 k tokens/s (bf16, one
step of 16,384 tokens in ~41 ms at 512-token rows; 25 M parameters at ~25% of an H200's dense bf16 peak plus launch
overhead; 1,024-token rows cost somewhat more attention, not measured here), 540 s in all leaves ~3.8 min a model,
~5,000 steps, 80 M tokens (25 epochs of the train split), in one 10-minute device command (the machine's start
counted). ``--steps N`` fixes the count (no timing). The train split is small: a long run repeats it many times,
and the validation loss in metrics.json shows what that does.

On the device, beside ``benchmarks/gpu_check.py`` in one 15-minute window (10 minutes a command at most,
the machine's start counted), as one command (``;``: the twins run even if a check section fails; they get
what is left of 570 s after the check)::

    export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$(date +%s); python3 benchmarks/gpu_check.py --out $OUT/bench; \
      python3 experiments/gpu_twins.py --out $OUT/gpu_twins --budget-s $((570 - $(date +%s) + T0))

or as two commands, ``PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT/bench`` (under 7.5 min) then
``PYTHONPATH=. python experiments/gpu_twins.py --out $OUT/gpu_twins`` (540 s, a command of its own). Writes three
files, so that
with gpu_check's two they stay within the 8 files a device run returns: ``<out>/report.md``, ``metrics.json``
(rewritten after each phase, so a run cut short keeps what it finished; it holds the training logs' losses,
evaluation losses and light observe passes, and every document's scores) and ``layers.png`` (per-layer max |x|
and first-token attention of both models, and their training and validation loss). The training runs
(log.jsonl, training.png, weights) stay in a temporary folder that is removed at the end; ``--work DIR``
keeps them there. Without CUDA and without ``--dry-run`` it exits with status 2 and one line instead of
training for hours on a CPU. Exit status 1 where a scheme failed (the others still run and are reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

VARIANTS = ("vanilla", "g1-elementwise")
SCHEMES = ("w8a8-int8-static", "w8a8-int8-bondarenko", "w8a8-int8-dynamic")
RESERVE_S = 75  # kept after training for observe, calibration and 8 evaluations (CUDA)
MIN_STEPS = 200  # the least a CUDA run trains, whatever the budget
PROBE_STEPS = 20
LOG_EVERY = 250  # steps between the logged observe passes (outliers, first-token attention) and evaluations
# the manipulation check, declared before any run (issue 56): the ungated twin must grow outliers and break under
# static INT8, or there is nothing for the gate to fix and the run reports "no test", not "no gate effect"
CHECK_RATIO, CHECK_BREAK = 500.0, 0.10
# d = 512, 6 layers, 8 heads of 64 (MHA), FFN 3 x d: small-llama's shape, widened
FULL = {
    "preset": "small-llama",
    "config": {
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1536,
    },
    "seq_len": 1024,  # long rows, each opening with BOS (quantgate's batches): where first-token outliers grow
    "batch_size": 16,
    "lr": 1e-3,
    "mixed_precision": "bf16",
    "limit": 24,
    "calib": 16,
    "calib_batch": 8,
    "observe_batches": 8,
    "observe_batch": 8,
    "eval_batch": 32,
    "probe_steps": PROBE_STEPS,
    "min_steps": MIN_STEPS,
    "max_steps": None,
    "reserve_s": RESERVE_S,
    "eval_batches": 4,
}
DRY = {
    "preset": "tiny-llama",
    "config": {},
    "seq_len": 32,
    "batch_size": 4,
    "lr": 1e-2,
    "mixed_precision": "no",
    "limit": 2,
    "calib": 2,
    "calib_batch": 4,
    "observe_batches": 2,
    "observe_batch": 4,
    "eval_batch": 64,
    "probe_steps": 3,
    "min_steps": 2,
    "max_steps": 6,
    "reserve_s": 0,
    "eval_batches": 1,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dry-run",
        "--smoke",
        dest="dry_run",
        action="store_true",
        help="the whole pipeline on a CPU in seconds: tiny-llama, 32-token rows, a few steps, 2 documents",
    )
    ap.add_argument("--out", default="results/gpu_twins", help="folder for report.md, metrics.json and the plots")
    ap.add_argument("--steps", default="auto", help="optimizer steps per model, or auto (sized to --budget-s)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds for the whole script, which --steps auto sizes the training to "
        "(default 540: one 10-minute device command; dry run 60)",
    )
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; dry run 1e-2)")
    ap.add_argument("--seq-len", type=int, default=None, help="training and evaluation length (default 1024)")
    ap.add_argument("--limit", type=int, default=None, help="quantgate_ppl test documents (default 24; dry run 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="keep the training runs (weights, logs) in this folder")
    args = ap.parse_args(argv)
    if args.steps != "auto" and not (args.steps.isdigit() and int(args.steps) >= 1):
        ap.error(f"--steps takes a whole number >= 1 or auto, not {args.steps!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_twins: no CUDA device here; the full run trains two 6-layer d=512 models (minutes on an H200, "
            "hours on a CPU): run it on a GPU, or pass --dry-run",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()
    import quantgate as qg  # after the check: the refusal needs no quantgate import
    from quantgate import experiment as ex

    cfg: dict[str, Any] = dict(DRY if args.dry_run else FULL)
    cfg.update({k: v for k, v in (("lr", args.lr), ("seq_len", args.seq_len), ("limit", args.limit)) if v is not None})
    cfg["budget_s"] = args.budget_s if args.budget_s is not None else (60.0 if args.dry_run else 540.0)
    cfg["seed"] = args.seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_twins-"))
    timings: dict[str, float] = {}
    rec: dict = {"dry_run": args.dry_run, "device": _device(), "config": cfg, "timings": timings, "models": {}}

    def save() -> None:
        (out / "metrics.json").write_text(json.dumps(rec, indent=1, default=str))

    try:
        tok = qg.tokenizer(build(qg, cfg, VARIANTS[0]))
        params = {v: sum(p.numel() for p in build(qg, cfg, v).parameters()) for v in VARIANTS}
        rec["parameters"] = params
        t = time.perf_counter()
        if args.steps == "auto":
            rec["probe"] = probe(qg, cfg, tok)
            steps = auto_steps(cfg, rec["probe"], elapsed=time.perf_counter() - t_start)
        else:
            steps = int(args.steps)
        cfg["steps"] = steps
        timings["probe_s"] = time.perf_counter() - t
        print(f"gpu_twins: {steps} steps a model ({steps * cfg['batch_size'] * cfg['seq_len']:,} tokens)", flush=True)
        save()
        docs = held_out_documents(qg, cfg["limit"])
        calibration = list(
            qg.data.batches(
                tok, "train", cfg["seq_len"], cfg["calib_batch"], "clm", seed=1, shuffle=True, max_batches=cfg["calib"]
            )
        )
        observe_data = [
            {k: b[k] for k in ("input_ids", "attention_mask")}
            for b in qg.data.batches(
                tok, "validation", cfg["seq_len"], cfg["observe_batch"], "clm", max_batches=cfg["observe_batches"]
            )
        ]
        models = {}
        for variant in VARIANTS:
            t = time.perf_counter()
            models[variant] = train_one(qg, cfg, variant, tok, work / variant)
            timings[f"train_{variant}_s"] = time.perf_counter() - t
            rec["models"][variant] = {"train": training_record(work / variant, kept=bool(args.work))}
            save()
        rec["documents"] = {
            "ids": list(range(len(docs))),
            "names": [d.id for d in docs],
            "works": [d.work for d in docs],
            "tokens": [len(tok(d.text, add_special_tokens=False).input_ids) for d in docs],
        }
        failed = False
        for variant, m in models.items():
            t = time.perf_counter()
            rec["models"][variant]["observe"] = observe_record(qg, m, observe_data, tok)
            timings[f"observe_{variant}_s"] = time.perf_counter() - t
            evals: dict[str, dict[str, Any]] = {}
            rec["models"][variant]["eval"] = evals
            for setting in ("float", *SCHEMES):
                t = time.perf_counter()
                try:
                    target = m if setting == "float" else quantized(qg, m, setting, calibration, cfg["calib"])
                    evals[setting] = {
                        "documents": ppl_documents(
                            target, tok, docs, cfg["seq_len"], cfg["eval_batch"], desc=f"eval {variant} {setting}"
                        )
                    }
                    evals[setting]["perplexity"] = qg_stats().aggregate(evals[setting]["documents"], "perplexity")
                    del target
                except Exception as e:  # one scheme failing must not lose the others
                    traceback.print_exc()
                    failed = True
                    evals[setting] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
                timings[f"eval_{variant}_{setting}_s"] = time.perf_counter() - t
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            save()
        t = time.perf_counter()
        rec["changes"], rec["differences"] = changes(rec)
        rec["manipulation_check"] = manipulation_check(rec)
        timings["intervals_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t_start
        save()
        plot(rec, out / "layers.png", ex)
        ex.write(out, report(rec, args, ex))
        save()
        print((out / "report.md").read_text())
        return 1 if failed else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- training


def build(qg, cfg: dict, variant: str):
    return qg.build(cfg["preset"], variant, seed=cfg["seed"], **cfg["config"])


def train_config(cfg: dict, steps: int, out: Path | None, eval_data: str | None = "validation"):
    from quantgate.train import TrainConfig

    every = LOG_EVERY if steps >= LOG_EVERY else steps // 10  # outliers and first-token attention logged
    return TrainConfig(
        steps=steps,
        batch_size=cfg["batch_size"],
        seq_len=cfg["seq_len"],
        lr=cfg["lr"],
        schedule="cosine",
        warmup=0.05,
        data="train",
        eval_data=eval_data,
        eval_every=every,
        observe_every=every,
        eval_batches=cfg["eval_batches"],
        log_every=max(1, steps // 200),
        seed=cfg["seed"],
        mixed_precision=cfg["mixed_precision"],
        norm_weight_decay=0.0,  # no decay on norm gains: it would pull down the gains that outliers grow through
        out=str(out) if out else None,
        overwrite=True,
    )


def train_one(qg, cfg: dict, variant: str, tok, run_dir: Path):
    """Train one twin into ``run_dir`` (its log.jsonl, training.png and model/)."""
    from quantgate.train import train

    model = train(build(qg, cfg, variant), tok, config=train_config(cfg, cfg["steps"], run_dir))
    return without_autocast(model).eval()


def without_autocast(model):
    """train() returns the model with accelerate's mixed-precision forward still on it (``unwrap_model`` keeps
    the fp32 wrapper): under bf16 its forward keeps running in autocast. Observe, quantize and evaluate the
    float32 model instead: drop the wrapper, so the class's own forward runs again."""
    if "_original_forward" in model.__dict__:
        model.__dict__.pop("forward", None)
        model.__dict__.pop("_original_forward")
    return model


class _Timed:
    """The training batches, each request timed: the gaps between requests are the step times."""

    def __init__(self, data):
        self.data, self.stamps = data, []

    def __iter__(self):
        for batch in self.data:
            self.stamps.append(time.perf_counter())
            yield batch


def probe(qg, cfg: dict, tok) -> dict:
    """Seconds per step of the gated model (the slower twin) and the fixed cost of a run (setup, kernel
    compilation), from ``probe_steps`` steps of a throwaway copy."""
    from quantgate.train import make_data, train

    c = train_config(cfg, cfg["probe_steps"], None, eval_data=None)
    data = _Timed(make_data(c, tok, "clm"))
    t0 = time.perf_counter()
    train(build(qg, cfg, VARIANTS[-1]), tok, data=data, config=c)
    total = time.perf_counter() - t0
    gaps = [b - a for a, b in itertools.pairwise(data.stamps)]
    step = statistics.median(gaps[len(gaps) // 2 :]) if gaps else total
    return {
        "steps": cfg["probe_steps"],
        "seconds": total,
        "step_s": step,
        "overhead_s": max(0.0, total - step * cfg["probe_steps"]),
        "tokens_per_s": cfg["batch_size"] * cfg["seq_len"] / step,
    }


def auto_steps(cfg: dict, measured: dict, elapsed: float) -> int:
    """Steps per model so that both trainings and the kept ``reserve_s`` fit in what is left of ``budget_s``
    (each model pays the probe's fixed cost again and steps 5% slower than the probe, to be safe)."""
    per_model = (cfg["budget_s"] - elapsed - cfg["reserve_s"]) / 2 - measured["overhead_s"]
    steps = int(per_model / (measured["step_s"] * 1.05)) if per_model > 0 else 0
    steps = max(cfg["min_steps"], steps)
    return min(steps, cfg["max_steps"]) if cfg["max_steps"] else steps


def training_record(run_dir: Path, kept: bool) -> dict:
    """The run's log: loss per logged step, evaluation loss, light observe passes, throughput."""
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    train_ = [r for r in log if r.get("event") == "train"]
    evals = [r for r in log if r.get("event") == "eval"]
    rates = [r["tokens_per_s"] for r in train_[1:]] or [r["tokens_per_s"] for r in train_]
    return {
        "steps": train_[-1]["step"],
        "tokens": train_[-1]["tokens"],
        "loss": [[r["step"], r["loss"]] for r in train_],
        "loss_first": train_[0]["loss"],
        "loss_last": train_[-1]["loss"],
        "eval_loss": [[r["step"], r["loss"]] for r in evals],
        "observe": [{k: v for k, v in r.items() if k != "event"} for r in log if r.get("event") == "observe"],
        "tokens_per_s": statistics.median(rates),
        "run": str(run_dir) if kept else None,
    }


# ---------------------------------------------------------------------------------------------------- measuring


def observe_record(qg, model, data: list[dict], tok) -> dict:
    report = qg.observe(model, data, tokenizer=tok)
    layers = [
        {
            "max_abs": L.max_activation,
            "max_median_ratio": L.tensors["block_out"].max_median_ratio,
            "first_token_attention": L.sink_mass,
            "gate_mean": L.gate_mean,
            "massive_activations": L.massive_activations,
        }
        for L in report.layers
    ]
    keys = (
        "max_activation",
        "max_median_ratio",
        "sink_mass",
        "kurtosis",
        "max_inf_norm",
        "massive_activations",
        "gate_mean",
    )
    summary = {k: getattr(report.summary, k) for k in keys}
    summary["max_layer_first_token_attention"] = max((L["first_token_attention"] or 0.0) for L in layers)
    return {"summary": summary, "layers": layers, "tokens": report.summary.tokens}


def quantized(qg, model, scheme: str, calibration: list[dict], calib: int):
    from quantgate.quant import get_scheme

    if get_scheme(scheme).needs_calibration:
        return qg.quantize(model, scheme, calibration=calibration, calib=calib)
    return qg.quantize(model, scheme)


def held_out_documents(qg, limit: int) -> list:
    """quantgate_ppl's documents: the test split taken in turn from each work (its ppl_documents), the first
    ``limit`` of them."""
    by_work: dict[str, list] = {}
    for d in qg.data.corpus("test"):
        by_work.setdefault(d.work, []).append(d)
    rows = [d for docs in itertools.zip_longest(*by_work.values()) for d in docs if d is not None]
    return rows[:limit]


def rolling_windows(n_tokens: int, max_length: int) -> list[tuple[int, int, int]]:
    """lm-eval's loglikelihood_rolling windows (get_rolling_token_windows with context_len 1, made disjoint)
    over a document of ``n_tokens`` with the prefix token before it, as (start, length, scored) in the
    prefixed sequence: the window's input is ``seq[start : start + length]`` and its last ``scored``
    predictions are counted; every document token is scored exactly once."""
    first = min(max_length, n_tokens)
    windows, predicted = [(0, first, first)], first
    while predicted < n_tokens:
        scored = min(n_tokens - predicted, max_length)
        end = predicted + scored  # lm-eval's input tokens[end - max_length - 1 : end - 1], shifted by the prefix
        windows.append((end - max_length, max_length, scored))
        predicted = end
    return windows


@torch.no_grad()
def ppl_documents(model, tok, docs: list, max_length: int, batch_size: int, desc: str = "eval") -> dict:
    """Per document: the summed log-likelihood (nats) of all its tokens under rolling windows of
    ``max_length`` (:func:`rolling_windows`), its token, word and byte counts: quantgate_ppl's columns
    as ``qg.evaluate`` returns them (``documents["quantgate_ppl"]``), without lm-eval."""
    from tqdm.auto import tqdm

    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    device = next(model.parameters()).device
    seqs, windows = [], []  # windows: (length, document, start, scored)
    for i, d in enumerate(docs):
        ids = tok(d.text, add_special_tokens=False).input_ids
        seqs.append(torch.tensor([prefix, *ids]))
        windows += [(n, i, s, k) for s, n, k in rolling_windows(len(ids), max_length)]
    windows.sort(key=lambda w: -w[0])  # equal lengths batch together, without padding
    loglik = [0.0] * len(docs)
    model.eval()
    batches = [windows[j : j + batch_size] for j in range(0, len(windows), batch_size)]
    groups = [list(g) for b in batches for _, g in itertools.groupby(b, key=lambda w: w[0])]
    for group in tqdm(groups, desc=desc, leave=False):
        n = group[0][0]
        x = torch.stack([seqs[i][s : s + n + 1] for _, i, s, _ in group]).to(device)  # inputs and their targets
        logits = model(input_ids=x[:, :-1]).logits.float()
        lp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        first = torch.tensor([n - k for *_, k in group], device=device)  # each window's first scored position
        scored = torch.arange(n, device=device)[None, :] >= first[:, None]
        for (_, i, _, _), v in zip(group, (lp * scored).double().sum(1).tolist(), strict=True):
            loglik[i] += v
    if not all(math.isfinite(v) for v in loglik):
        raise ValueError("a document scores a non-finite log-likelihood: the model's outputs are NaN or inf")
    return {
        "ids": list(range(len(docs))),
        "loglikelihood": loglik,
        "tokens": [len(s) - 1 for s in seqs],
        "words": [len(re.split(r"\s+", d.text)) for d in docs],
        "bytes": [len(d.text.encode()) for d in docs],
        "works": [d.work for d in docs],
    }


# ---------------------------------------------------------------------------------------------------- intervals


def qg_stats():
    from quantgate import stats

    return stats


def jackknife_difference(base: tuple[dict, dict], other: tuple[dict, dict], confidence: float = 0.95):
    """``other``'s relative change of perplexity minus ``base``'s (each pair: float documents, quantized
    documents, the same documents), with a jackknife t-interval over documents (n - 1 degrees of freedom):
    the fallback where quantgate.stats has no paired_difference."""
    import scipy.stats

    stats = qg_stats()
    cols = [
        np.asarray(d[c], dtype=np.float64) for pair in (base, other) for d in pair for c in ("loglikelihood", "tokens")
    ]

    def change(lf, tf, lq, tq):
        return np.expm1(lf.sum(-1) / tf.sum(-1) - lq.sum(-1) / tq.sum(-1))

    def statistic(*c):
        return change(*c[4:]) - change(*c[:4])

    n, value = len(cols[0]), float(statistic(*cols))
    if n < 2:
        return stats.Delta(value, None, None, "points", n, f"no interval: {n} document")
    keep = ~np.eye(n, dtype=bool)
    loo = statistic(*(np.broadcast_to(c, (n, n))[keep].reshape(n, n - 1) for c in cols))
    se = math.sqrt((n - 1) / n * float(((loo - loo.mean()) ** 2).sum()))
    half = float(scipy.stats.t.ppf((1 + confidence) / 2, n - 1)) * se
    return stats.Delta(
        value,
        value - half,
        value + half,
        "points",
        n,
        f"jackknife t-interval over {n} documents ({n - 1} df), computed in experiments/gpu_twins.py "
        "(quantgate.stats has no paired_difference)",
    )


def paired_difference(base: tuple[dict, dict], other: tuple[dict, dict]):
    stats = qg_stats()
    if hasattr(stats, "paired_difference"):
        return stats.paired_difference(base, other, "perplexity")
    return jackknife_difference(base, other)


def changes(rec: dict) -> tuple[dict, dict]:
    """Per model and scheme, the change of perplexity from its float evaluation (paired interval); per scheme,
    the gated minus the ungated change (paired interval), and the gated float model against the ungated one."""
    stats = qg_stats()
    ev = {v: rec["models"][v]["eval"] for v in VARIANTS}
    docs = {v: {s: e["documents"] for s, e in ev[v].items() if "documents" in e} for v in VARIANTS}
    per: dict = {v: {} for v in VARIANTS}
    diff: dict = {}
    for scheme in SCHEMES:
        for v in VARIANTS:
            if "float" in docs[v] and scheme in docs[v]:
                per[v][scheme] = _delta(stats.paired_delta(docs[v]["float"], docs[v][scheme], "perplexity"), stats)
            else:
                per[v][scheme] = {"value": None, "method": f"no change: {_why(ev[v], scheme)}"}
        if all("float" in docs[v] and scheme in docs[v] for v in VARIANTS):
            d = paired_difference(*((docs[v]["float"], docs[v][scheme]) for v in VARIANTS))
            diff[scheme] = _delta(d, stats) | {
                "difference_of_changes": per[VARIANTS[1]][scheme]["value"] - per[VARIANTS[0]][scheme]["value"]
            }
        else:
            diff[scheme] = {"value": None, "method": "no difference: a change is missing"}
    if all("float" in docs[v] for v in VARIANTS):
        per["gated_vs_ungated_float"] = _delta(
            stats.paired_delta(docs[VARIANTS[0]]["float"], docs[VARIANTS[1]]["float"], "perplexity"), stats
        )
    return per, diff


def _why(evals: dict, scheme: str) -> str:
    missing = [s for s in ("float", scheme) if "documents" not in evals.get(s, {})]
    return "; ".join(f"{s} failed ({evals.get(s, {}).get('error', 'not run')})" for s in missing)


def _delta(d, stats) -> dict:
    return dataclasses.asdict(d) | {"text": stats.format_delta(d)}


# ---------------------------------------------------------------------------------------------------- output


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": "cpu", "torch": torch.__version__}
    return {
        "kind": "cuda",
        "name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
    }


def plot(rec: dict, path: Path, ex) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for v, colour in zip(VARIANTS, ("C3", "C0"), strict=True):
        m = rec["models"][v]
        layers = m["observe"]["layers"]
        axes[0].plot([L["max_abs"] for L in layers], marker="o", color=colour, label=v)
        axes[1].plot([L["first_token_attention"] or 0 for L in layers], marker="o", color=colour, label=v)
        loss = m["train"]["loss"]
        axes[2].plot([s for s, _ in loss], [x for _, x in loss], color=colour, label=f"{v} train")
        ev = m["train"]["eval_loss"]
        axes[2].plot([s for s, _ in ev], [x for _, x in ev], color=colour, ls="--", marker=".", label=f"{v} validation")
    axes[0].set(xlabel="block", ylabel="max |x| (residual stream)", yscale="log", title="outliers per layer")
    axes[1].set(xlabel="block", ylabel="first-token attention", ylim=(0, 1), title="attention sink per layer")
    for a in axes[:2]:
        a.set_xticks(range(len(rec["models"][VARIANTS[0]]["observe"]["layers"])))
    axes[2].set(xlabel="step", ylabel="loss (nats)", title="training")
    for a in axes:
        a.legend(fontsize=7)
    ex.save_figure(fig, path)


def report(rec: dict, args: argparse.Namespace, ex) -> list[str]:
    stats = qg_stats()
    cfg, t, dev = rec["config"], rec["timings"], rec["device"]
    tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    shape = ", ".join(f"{k}={v}" for k, v in cfg["config"].items()) or "its own shape"
    command = "python experiments/gpu_twins.py" + (" --dry-run" if args.dry_run else "")
    command += "".join(
        f" {flag} {v}"
        for flag, v in (
            ("--steps", None if args.steps == "auto" else args.steps),
            ("--budget-s", args.budget_s),
            ("--lr", args.lr),
            ("--seq-len", args.seq_len),
            ("--limit", args.limit),
        )
        if v is not None
    )
    what = (
        "An ungated Llama and its G1-gated twin (same preset, config, data, steps, learning rate and seed), "
        "trained here, observed, quantized to INT8 three ways and evaluated on held-out documents: does the "
        "gate keep the model quantizable where the ungated one grows outliers?"
    )
    if args.dry_run:
        what += " **Dry run**: a tiny random-scale config that checks the pipeline; its numbers mean nothing."
    lines = ex.header("GPU twins: ungated vs G1-gated Llama under INT8", command, t.get("total_s", 0), what)
    gpu = f"**{dev['name']}**" if dev["kind"] == "cuda" else "no GPU (CPU)"
    if dev["kind"] == "cuda":
        gpu += f" (compute capability {dev['capability']}, {dev['memory_gib']} GiB, CUDA {dev['cuda']})"
    lines += [f"Device: {gpu}, torch {dev['torch']}.", ""]
    steps = cfg["steps"]
    probe_ = rec.get("probe")
    sizing = (
        f"sized by --steps auto to a {cfg['budget_s']:.0f} s budget from {probe_['steps']} timed steps of the "
        f"gated model ({probe_['step_s'] * 1e3:.1f} ms a step, {probe_['tokens_per_s']:,.0f} tokens/s, "
        f"{probe_['overhead_s']:.1f} s fixed cost)"
        if probe_
        else "given by --steps"
    )
    lines += [
        "## Setup",
        "",
        f"`{cfg['preset']}` with {shape}: {rec['parameters'][VARIANTS[0]]:,} parameters ungated, "
        f"{rec['parameters'][VARIANTS[1]]:,} with the G1 gate. Both trained for {steps:,} steps ({sizing}) of "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens ({steps * tokens_per_step:,} tokens of the "
        f"bundled train split), lr {cfg['lr']:g} cosine, seed {cfg['seed']}, mixed precision "
        f"{cfg['mixed_precision']}. Observed on {cfg['observe_batches']} validation batches of "
        f"{cfg['observe_batch']} x {cfg['seq_len']}; static schemes calibrated on the same {cfg['calib']} train "
        f"batches of {cfg['calib_batch']} x {cfg['seq_len']} for both models. Perplexity on the first "
        f"{len(rec['documents']['ids'])} documents of quantgate_ppl ({sum(rec['documents']['tokens']):,} tokens, "
        f"{len(set(rec['documents']['works']))} works), scored here with lm-eval's rolling windows of "
        f"{cfg['seq_len']} tokens (no lm-eval needed).",
        "",
    ]
    lines += [
        "## Training",
        "",
        *stats.table_head(["model", "steps", "first loss", "last loss", "validation loss", "tokens/s", "seconds"]),
    ]
    for v in VARIANTS:
        tr = rec["models"][v]["train"]
        val = tr["eval_loss"][-1][1] if tr["eval_loss"] else None
        lines.append(
            f"| {v} | {tr['steps']:,} | {tr['loss_first']:.3f} | {tr['loss_last']:.3f} | {stats.fmt(val)} | "
            f"{tr['tokens_per_s']:,.0f} | {t[f'train_{v}_s']:.0f} |"
        )
    lines += [
        "",
        "## Outliers and sinks (float models)",
        "",
        *stats.table_head(
            [
                "model",
                "max abs",
                "max / median",
                "first-token attention (max layer)",
                "kurtosis",
                "massive activations",
                "mean gate",
            ]
        ),
    ]
    for v in VARIANTS:
        s = rec["models"][v]["observe"]["summary"]
        lines.append(
            f"| {v} | {stats.fmt(s['max_activation'])} | {stats.fmt(s['max_median_ratio'])} | "
            f"{stats.fmt(s['max_layer_first_token_attention'])} | {stats.fmt(s['kurtosis'])} | "
            f"{s['massive_activations']} | {stats.fmt(s['gate_mean'])} |"
        )
    lines += [
        "",
        *stats.table_head(
            ["block", *(f"{v} {q}" for v in VARIANTS for q in ("max abs", "max / median", "first-token attention"))]
        ),
    ]
    for i, layers in enumerate(zip(*(rec["models"][v]["observe"]["layers"] for v in VARIANTS), strict=True)):
        cells = [stats.fmt(L[k]) for L in layers for k in ("max_abs", "max_median_ratio", "first_token_attention")]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![layers.png](layers.png)",
        "",
        "## Quantization",
        "",
        "Change of perplexity from each model's float evaluation, 95% paired interval over documents; the "
        "last column is the gated change minus the ungated one, in percentage points, with its own paired "
        "interval over the same documents (negative: the gate loses less). " + stats.NOISE_LEGEND + ".",
        "",
        *stats.table_head(
            ["scheme", *(f"{v} ppl" for v in VARIANTS), *(f"{v} change" for v in VARIANTS), "gated - ungated"]
        ),
    ]
    ppl = {v: rec["models"][v]["eval"] for v in VARIANTS}
    lines.append(
        "| float | "
        + " | ".join(stats.fmt(ppl[v]["float"].get("perplexity")) for v in VARIANTS)
        + " | - | - | "
        + rec["changes"].get("gated_vs_ungated_float", {}).get("text", "-")
        + " (gated float vs ungated float) |"
    )
    for scheme in SCHEMES:
        ch = [rec["changes"][v][scheme] for v in VARIANTS]
        cells = [
            stats.fmt(ppl[v][scheme].get("perplexity"))
            if "perplexity" in ppl[v][scheme]
            else ppl[v][scheme].get("error", "-")
            for v in VARIANTS
        ]
        cells += [c.get("text") or c["method"] for c in ch]
        d = rec["differences"][scheme]
        lines.append(f"| `{scheme}` | " + " | ".join(cells) + f" | {d.get('text') or d['method']} |")
    methods = sorted(
        {c["method"] for v in VARIANTS for c in rec["changes"][v].values()}
        | {d["method"] for d in rec["differences"].values()}
    )
    lines += [
        "",
        "Intervals: " + "; ".join(methods) + ".",
        "",
        "## Reading",
        "",
        *reading(rec),
        "",
        "## Timings",
        "",
        *stats.table_head(["phase", "seconds"]),
        *(f"| {k.removesuffix('_s')} | {v:.1f} |" for k, v in t.items()),
        "",
    ]
    return lines


def manipulation_check(rec: dict) -> dict:
    """The declared check: the ungated twin's max / median reaches CHECK_RATIO and its static W8A8 change's interval
    lies at or above CHECK_BREAK. Where it fails, the gate could not show an effect on this pair ("no test")."""
    ratio = rec["models"]["vanilla"]["observe"]["summary"]["max_median_ratio"]
    change = rec["changes"]["vanilla"]["w8a8-int8-static"]
    low = change.get("low")
    failed = []
    if ratio is None or ratio < CHECK_RATIO:
        failed.append(f"the ungated twin's max / median is {ratio:.4g}, below {CHECK_RATIO:g}" if ratio is not None
                      else "the ungated twin's max / median is unknown")  # fmt: skip
    if low is None or low < CHECK_BREAK:
        failed.append(f"its static W8A8 change ({change.get('text', 'none')}) is not wholly at or above "
                      f"+{CHECK_BREAK:.0%}")  # fmt: skip
    passed = not failed
    text = ("passed: the ungated twin grows outliers and breaks under static W8A8" if passed
            else "failed, so no test of the gate: " + "; ".join(failed))  # fmt: skip
    return {"passed": passed, "text": text, "max_median_ratio": ratio, "static_low": low}


def reading(rec: dict) -> list[str]:
    """What the numbers say, in sentences generated from them."""
    obs = {v: rec["models"][v]["observe"]["summary"] for v in VARIANTS}
    out = [
        f"The ungated model reaches max |x| {obs['vanilla']['max_activation']:.4g} (max / median "
        f"{obs['vanilla']['max_median_ratio']:.4g}, first-token attention up to "
        f"{obs['vanilla']['max_layer_first_token_attention']:.2f}); its gated twin "
        f"{obs['g1-elementwise']['max_activation']:.4g} ({obs['g1-elementwise']['max_median_ratio']:.4g}, "
        f"{obs['g1-elementwise']['max_layer_first_token_attention']:.2f})."
    ]
    check = rec.get("manipulation_check") or manipulation_check(rec)
    out.append(f"Manipulation check (declared before the run): {check['text']}.")
    for scheme in SCHEMES:
        d = rec["differences"][scheme]
        if d.get("value") is None:
            continue
        ch = [rec["changes"][v][scheme]["text"] for v in VARIANTS]
        verdict = (
            "no test (the manipulation check failed)"
            if not check["passed"]
            else (
                "the gate loses less"
                if d["high"] is not None and d["high"] < 0
                else "the gate loses more"
                if d["low"] is not None and d["low"] > 0
                else "no difference beyond noise"
                if d["low"] is not None
                else "no interval"
            )
        )
        out.append(f"`{scheme}`: ungated {ch[0]}, gated {ch[1]}; gated - ungated {d['text']}: {verdict}.")
    return [" ".join(out)]


if __name__ == "__main__":
    sys.exit(main())
