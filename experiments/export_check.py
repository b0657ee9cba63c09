"""Do quantgate's SmolLM2-135M checkpoints open correctly in plain transformers and lm-eval?

For each scheme below, SmolLM2-135M is quantized (calibration: 2 batches of 8 x 128 tokens of the
bundled train split, as ``quantgate quantize smollm2-135m --scheme S --calib 2 --out D`` does), saved
with ``qg.save`` and opened twice: by ``qg.load`` and by plain ``AutoModelForCausalLM.from_pretrained``
(no quantgate code: what lm-eval's ``hf`` model and other readers do).

Success criterion (issue 30's acceptance, fixed before the runs):

* every folder loads in plain transformers with no missing and no unexpected key;
* torchao-int8-dynamic and llm-int8: transformers' logits equal ``qg.load``'s (max |diff| <= 1e-4);
* the compressed-tensors exports (w8a8-int8-dynamic, w8a8-int8-static, w8a8-fp8-e4m3, w4a4-nvfp4):
  transformers' word perplexity within 0.5% of ``qg.load``'s on the same documents (paired, with its
  95% interval);
* the INT8 compressed-tensors folder (w8a8-int8-static) takes <= 0.35x the float folder's bytes;
* ``lm_eval --model hf`` on the w8a8-int8-static export gives ``qg.evaluate``'s word perplexity within 0.1%;
* w8a8-int8-bondarenko and the packaged gated twin (twin-g1, saved again): plain transformers raises an
  error naming quantgate; ``qg.load`` gives the saved model's logits exactly.

A scheme quantgate cannot write in another tool's format is reported as such (its folder must then be
refused by plain transformers, never loaded as something else).

Writes results/export_check/report.md and metrics.json. ``python experiments/export_check.py``
(about 15 min on the 2-core CPU here; ``--limit`` documents of quantgate_ppl, default 12, 512-token windows).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

import quantgate as qg
from quantgate.provenance import versions
from quantgate.quant import get_scheme, quantizers
from quantgate.quant.export import export_format
from quantgate.stats import Delta, change, format_delta, table_row

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("torchao-int8-dynamic", "llm-int8", "w8a8-int8-dynamic", "w8a8-int8-static", "w8a8-fp8-e4m3", "w4a4-nvfp4")
REFUSED = ("w8a8-int8-bondarenko",)
EXACT = ("torchao", "bitsandbytes")  # formats whose logits must match qg.load's
WINDOW = 512


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix == ".safetensors")


def plain(path: Path) -> tuple[torch.nn.Module | None, dict]:
    """transformers alone; the error it raises, if it refuses."""
    try:
        model, info = cast(  # output_loading_info: (model, loading info), which transformers' hints do not say
            tuple[PreTrainedModel, dict[str, Any]],
            AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype="auto"),
        )
    except (ValueError, OSError, RuntimeError) as e:
        return None, {"refused": str(e).splitlines()[0]}
    return model.eval(), {"missing": len(info["missing_keys"]), "unexpected": len(info["unexpected_keys"])}


@contextmanager
def ct_arithmetic() -> Iterator[None]:
    """quantgate's integer round trip computed as compressed-tensors' forward does: ``round(x / s + z)``
    (PyTorch's fused fake_quantize, which quantgate uses, computes ``round(x * (1 / s)) + z``). The two differ
    only where ``x / s`` lies within a float32 rounding error of a half step; used to show that this, and
    nothing else, separates transformers' numbers from quantgate's on the integer exports."""

    def fake_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
        qmin, qmax = quantizers.int_grid(bits, symmetric)
        s, z = scale.float(), torch.round(zero.float())  # one value, (C,) or x.shape[:-1] + (1,): broadcast
        return (torch.round(x / s + z).clamp(qmin, qmax) - z) * s

    saved = quantizers.fake_int
    quantizers.fake_int = fake_int
    try:
        yield
    finally:
        quantizers.fake_int = saved


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def ppl(model: torch.nn.Module, tok, limit: int) -> dict:
    out = qg.evaluate(model, tok, ["quantgate_ppl"], limit=limit, max_length=WINDOW)
    return {"value": out.results["quantgate_ppl"]["word_perplexity"], "documents": out.documents["quantgate_ppl"]}


def lm_eval_ppl(path: Path, limit: int, out: Path) -> float:
    """word perplexity from lm-eval's own command line, its hf model, quantgate's task folder."""
    args = f"pretrained={path},dtype=float32,add_bos_token=False,max_length={WINDOW}"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", args, "--tasks", "quantgate_ppl"]
    cmd += ["--include_path", str(ROOT / "quantgate" / "tasks"), "--limit", str(limit), "--batch_size", "8"]
    subprocess.run([*cmd, "--output_path", str(out)], check=True, capture_output=True, text=True)
    (results,) = out.rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]["quantgate_ppl"]
    return float(next(v for k, v in metrics.items() if re.fullmatch("word_perplexity,none", k)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=12, help="quantgate_ppl documents (default 12)")
    parser.add_argument("--out", default=str(ROOT / "results" / "export_check"))
    parser.add_argument("--save-dtype", default="bfloat16", help="storage dtype of the exports' float tensors")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="qg-export-"))
    start = time.perf_counter()
    model = qg.load("smollm2-135m")
    tok = qg.tokenizer(model)
    ids = next(iter(qg.data.batches(tok, "validation", seq_len=128, batch_size=2, max_batches=1)))["input_ids"]
    qg.save(model, work / "float")
    float_bytes = folder_bytes(work / "float")
    rows = []
    for scheme in tqdm(SCHEMES + REFUSED, desc="schemes"):
        calib = qg.data.batches(tok, "train", seq_len=128, batch_size=8)
        t0 = time.perf_counter()
        calibrates = get_scheme(scheme).needs_calibration or get_scheme(scheme).export_calibration
        options: dict[str, Any] = {"calib": 2} if calibrates else {}
        q = qg.quantize(model, scheme, calibration=calib, **options)
        path = work / scheme
        dtype = getattr(torch, args.save_dtype)
        fmt = export_format(q, get_scheme(scheme))[0]
        qg.save(q, path, dtype=dtype if fmt == "compressed-tensors" else None)
        ours = qg.load(path)
        theirs, load = plain(path)
        row: dict = {"scheme": scheme, "format": fmt, "bytes": folder_bytes(path), **load}
        row["size_ratio"] = row["bytes"] / float_bytes
        row["reload_equal"] = bool(torch.equal(logits(ours, ids), logits(q, ids)))
        if theirs is not None:
            row["max_logit_diff"] = float((logits(theirs, ids).float() - logits(ours, ids)).abs().max())
            if fmt not in EXACT:
                a, b = ppl(ours, tok, args.limit), ppl(theirs, tok, args.limit)
                d = change("word_perplexity", a["value"], b["value"], a["documents"], b["documents"])
                assert d is not None  # both evaluations kept their documents
                row |= {"ppl_quantgate": a["value"], "ppl_transformers": b["value"]}
                row |= {"ppl_change": d.value, "ppl_change_low": d.low, "ppl_change_high": d.high}
                if scheme == "w8a8-int8-static":
                    with ct_arithmetic():  # is the rounding convention all that differs?
                        diff = (logits(theirs, ids) - logits(ours, ids)).abs().max()
                        row["max_logit_diff_ct_arithmetic"] = float(diff)
                        row["ppl_quantgate_ct_arithmetic"] = ppl(ours, tok, args.limit)["value"]
                    row["ppl_lm_eval"] = lm_eval_ppl(path, args.limit, work / "lm_eval")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    twin = qg.load("twin-g1")
    qg.save(twin, work / "twin-g1")
    _, twin_load = plain(work / "twin-g1")
    twin_ids = torch.randint(5, 8000, (2, 24), generator=torch.Generator().manual_seed(0))
    twin_row = {
        **twin_load,
        "reload_equal": bool(torch.equal(logits(qg.load(work / "twin-g1"), twin_ids), logits(twin, twin_ids))),
    }
    metrics = {
        "model": "smollm2-135m",
        "limit": args.limit,
        "window": WINDOW,
        "save_dtype": args.save_dtype,
        "float_bytes": float_bytes,
        "rows": rows,
        "twin_g1": twin_row,
        "seconds": round(time.perf_counter() - start, 1),
        "machine": f"{platform.system()} {platform.machine()}, {torch.get_num_threads()} torch threads",
        "versions": versions(
            ("quantgate", "torch", "transformers", "compressed_tensors", "torchao", "bitsandbytes", "lm_eval")
        ),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "report.md").write_text(report(metrics))
    print(report(metrics))


def report(m: dict) -> str:
    lines = [
        "# Export check: SmolLM2-135M checkpoints in plain transformers and lm-eval",
        "",
        f"Generated by `python experiments/export_check.py` ({m['seconds'] / 60:.1f} min; {m['machine']}). "
        f"Calibration: 2 batches of 8 x 128 train tokens. Perplexity: quantgate_ppl, {m['limit']} documents, "
        f"{m['window']}-token windows; the change is transformers' over qg.load's on the same documents, "
        f"paired over documents (95% interval). Exports store their full-precision tensors in "
        f"{m['save_dtype']} (`--save-dtype`); the float folder is qg.save's float32 "
        f"({m['float_bytes'] / 1e6:.0f} MB of weights). 'reload = saved': qg.load's logits equal the in-memory "
        f"quantized model's bit for bit; the compressed-tensors rows differ by the {m['save_dtype']} rounding of "
        f"their full-precision tensors (at float32 storage they are equal: tests/test_export.py). 'max logit diff': "
        f"transformers against qg.load, over 2 x 128 validation tokens.",
        "",
        "| scheme | format | plain transformers | reload = saved | max logit diff | ppl qg.load | ppl transformers "
        "| change | size / float |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in m["rows"]:
        loaded = (
            f"refused: {r['refused'][:60]}"
            if "refused" in r
            else f"missing {r['missing']}, unexpected {r['unexpected']}"
        )
        d = None
        if "ppl_change" in r:
            d = Delta(r["ppl_change"], r["ppl_change_low"], r["ppl_change_high"], "perplexity", m["limit"], "paired")
        cells = [
            r["scheme"],
            r["format"],
            loaded,
            "yes" if r["reload_equal"] else "no",
            f"{r['max_logit_diff']:.2g}" if "max_logit_diff" in r else "-",
            f"{r['ppl_quantgate']:.3f}" if "ppl_quantgate" in r else "-",
            f"{r['ppl_transformers']:.3f}" if "ppl_transformers" in r else "-",
            format_delta(d) if d is not None else "-",
            f"{r['size_ratio']:.3f}x",
        ]
        lines.append(table_row(cells))
    lm = next((r for r in m["rows"] if "ppl_lm_eval" in r), None)
    if lm is not None:
        rel = lm["ppl_lm_eval"] / lm["ppl_quantgate"] - 1
        lines += [
            "",
            f"lm-eval's own CLI (`lm_eval --model hf --model_args pretrained=DIR,dtype=float32,add_bos_token=False,"
            f"max_length={m['window']} --include_path quantgate/tasks`) on the {lm['scheme']} export: word perplexity "
            f"{lm['ppl_lm_eval']:.3f}, qg.evaluate on qg.load's model {lm['ppl_quantgate']:.3f} ({rel:+.4%}).",
        ]
    ct = next((r for r in m["rows"] if "ppl_quantgate_ct_arithmetic" in r), None)
    if ct is not None:
        rel = ct["ppl_transformers"] / ct["ppl_quantgate_ct_arithmetic"] - 1
        lines += [
            "",
            f"{ct['scheme']} with quantgate's integer round trip computed as compressed-tensors' forward computes it "
            f"(`round(x / s + z)` instead of PyTorch's fused `round(x * (1 / s)) + z`; `ct_arithmetic` in the script): "
            f"qg.load's word perplexity {ct['ppl_quantgate_ct_arithmetic']:.3f}, "
            f"transformers' {ct['ppl_transformers']:.3f} "
            f"({rel:+.4%}), max logit diff {ct['max_logit_diff_ct_arithmetic']:.2g}. The two conventions differ only "
            f"where x / s lies within a float32 rounding error of a half step; here static INT8 is broken (massive "
            f"activations set the scale), so those single-step flips move perplexity by the amount in the table.",
        ]
    t = m["twin_g1"]
    twin = f"refused ({t['refused'][:80]})" if "refused" in t else f"LOADED (missing {t['missing']})"
    lines += [
        "",
        f"twin-g1 (G1-gated float) saved by qg.save: plain transformers {twin}; qg.load equal: {t['reload_equal']}.",
    ]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
