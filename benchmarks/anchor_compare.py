"""quantgate's per-site fallback beside NVIDIA ModelOpt's ``auto_quantize``, on the same documents and tolerance.

ModelOpt's recipes come from benchmarks/anchor_modelopt.py (its own venv: ``mtq.auto_quantize`` with INT8_DEFAULT_CFG
against leaving a layer unquantized, method "gradient", at effective-bits targets 8.1 .. 12; its search.json lists
the Linears each recipe leaves unquantized). quantgate's come from an audit's audit.json (benchmarks/audit.py
``--keep``). Each recipe is quantgate's ``w8a8-int8-static`` with those Linears kept (``keep=``), scored by the audit's
own scorer on the audit's own sets: its search passages (test split) in bfloat16 and its held-out passages
(validation split) in float32, each change with its 95% interval paired over the passages, clustered by work.

ModelOpt never measures accuracy: it ranks layers by a gradient-weighted output error and solves for a size
budget; whether its recipe is within a tolerance is for the user to find out. Success criterion, fixed before the
run: the comparison names, for each recipe, the Linears kept, the effective bits, the change on both sets with its
interval and whether it is certified at +1% (the held-out interval wholly below), and the tools' times.

    python benchmarks/anchor_compare.py --modelopt /tmp/anchor-modelopt/search.json \\
        --audit /tmp/smollm2-audit/audit.json --out results/bench/anchor-compare-smollm2-cpu.md

About 1 minute per recipe on a quiet 2-core CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import quantgate as qg
from quantgate.audit.documents import DocSet
from quantgate.audit.record import AuditRecord
from quantgate.audit.search import Search, fresh_copy
from quantgate.audit.sites import keep_scheme
from quantgate.certify import certifies
from quantgate.eval.tasks import TASKS
from quantgate.stats import format_delta, paired_delta
from quantgate.study.grid import DataSettings

BASE = "w8a8-int8-static"
CALIBRATION = DataSettings(data="train", batches=4, seq_len=128, batch_size=8)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt", type=Path, required=True, help="anchor_modelopt.py's search.json")
    ap.add_argument("--audit", type=Path, required=True, help="an audit's audit.json (SmolLM2-135M)")
    ap.add_argument("--out", type=Path, default=Path("results/bench/anchor-compare-smollm2-cpu.md"))
    ap.add_argument("--within", type=float, default=0.01)
    args = ap.parse_args(argv)
    opt = json.loads(args.modelopt.read_text())
    record = AuditRecord.from_json(json.loads(args.audit.read_text()))
    n = int(record.search_documents.split()[0])
    model = qg.load("smollm2-135m", dtype=torch.bfloat16).eval()
    tok = qg.tokenizer(model)
    passages = TASKS["quantgate_passages"]  # the audit's text sets: passages of the bundled text
    search = Search(model, tok, CALIBRATION, DocSet(passages, "search", n), args.within, fresh_copy(model))
    held = DocSet(passages, "held-out", n)
    reference = held.score(copy.deepcopy(model).float(), tok)
    recipes = [("ModelOpt", r["target"], list(r["unquantized"])) for r in opt["recipes"] if r["how"] != "auto_quantize"]
    ours = [c for c in record.candidates if c.base == BASE and c.kept]
    recipes += [("quantgate", None, list(c.kept)) for c in ours]
    rows = []
    for tool, target, kept in recipes:
        start = time.perf_counter()
        q = search.quantize(keep_scheme(BASE, kept))
        d_search = search.change(q)
        d_held = paired_delta(reference, held.score(copy.deepcopy(q).float(), tok), "perplexity")
        bits = search.cost_of(BASE, tuple(kept), set(search.linear_params) - {"lm_head"}).compute_bits
        verdict = "yes" if certifies(d_held, args.within) else "no"
        rows.append(
            f"| {tool} | {'-' if target is None else target} | {len(kept)} | {bits:.2f} | {format_delta(d_search)} "
            f"| {format_delta(d_held)} | {verdict} | {time.perf_counter() - start:.0f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Per-site fallback: quantgate's audit beside ModelOpt's auto_quantize (SmolLM2-135M, static INT8)",
            "",
            f"Command: `python benchmarks/anchor_compare.py --modelopt {args.modelopt} --audit {args.audit} --out "
            f"{args.out}`; the module docstring says what each column is. Sets: {record.search_documents} (search, "
            f"bfloat16), {record.held_out_documents} (held out, float32). ModelOpt "
            f"{opt['versions'].get('nvidia-modelopt', '?')} "
            f"ran `auto_quantize` (method {opt['method']}, {opt['format']}, {opt['groups']} layer groups) in "
            f"{opt['auto_quantize_seconds']:.0f} s on this machine (its scoring; the other cores were busy with other "
            f"work then); quantgate's audit took {record.seconds:.0f} s in all (every scheme, the fallback, the "
            "certificate).",
            "",
            "| tool | effective-bits target | Linears kept in 16-bit | matmul bits (quantgate's count) | search change "
            "[95% CI] | held-out change [95% CI] (float32) | certified at +1% | s |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
