"""The audit's evaluation set against the main job's, at equal words read: how wide is a change's interval?

The main job's set (quantgate_ppl) reads whole documents of the bundled test split, in turn from each of its nine
works; three plays' acts hold most of its words. The audit's set (``quantgate.data.corpus.passages``) cuts the same
documents into passages of at most 256 words and takes them in turn from each work, so that every work weighs about
the same. Both are scored by the audit's scorer (``quantgate.audit.documents.score_text``: disjoint 512-token
windows, log-probabilities in float32, sums in float64) for SmolLM2-135M in bfloat16 and two schemes (per-token INT8,
and per-token INT8 after online Hadamard rotations, QuaRot's recipe); each set is read from its start until it
holds at least W words, and the change's 95% interval (paired, clustered by work) is computed at each W.

Success criterion, fixed before the run: at every W the passages' interval is narrower than the documents' for both
schemes.

    python benchmarks/passage_width.py --out results/bench/passage_width-smollm2-cpu.md

About 5 minutes on a quiet 2-core CPU.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

import quantgate as qg
from quantgate.audit.documents import score_text
from quantgate.data.corpus import Document, corpus, in_turn, passages
from quantgate.stats import format_delta, paired_delta
from quantgate.study.grid import DataSettings
from quantgate.study.steps import quantize_calibrated

WORDS = (4000, 8000, 16000, 24000)
SCHEMES = ("w8a8-int8-dynamic", "w8a8-int8-dynamic:rotate=online")


def _words(d: Document) -> int:
    return len(re.findall(r"\S+", d.text))


def _first(docs: list[Document], words: int) -> int:
    """How many documents from the start hold at least ``words`` words."""
    total = 0
    for i, d in enumerate(docs):
        total += _words(d)
        if total >= words:
            return i + 1
    return len(docs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench/passage_width-smollm2-cpu.md"))
    args = ap.parse_args(argv)
    sets = {"documents (main job)": in_turn(corpus("test")), "passages (audit)": passages("test")}
    sizes = {name: [_first(docs, w) for w in WORDS] for name, docs in sets.items()}
    model = qg.load("smollm2-135m", dtype=torch.bfloat16).eval()
    tok = qg.tokenizer(model)
    calibration = DataSettings(data="train", batches=4, seq_len=128, batch_size=8)
    floats = {name: score_text(model, tok, docs[: max(sizes[name])], 512) for name, docs in sets.items()}
    rows = []
    for scheme in SCHEMES:
        q = quantize_calibrated(qg.load("smollm2-135m", dtype=torch.bfloat16), tok, scheme, calibration, 0, True)
        for name, docs in sets.items():
            scored = score_text(q, tok, docs[: max(sizes[name])], 512)
            for w, n in zip(WORDS, sizes[name], strict=True):
                d = paired_delta(floats[name].first(n), scored.first(n), "perplexity")
                width = 100 * (d.high - d.low) if d.high is not None and d.low is not None else float("nan")
                works = len(set(floats[name].first(n).works or ()))
                rows.append(
                    f"| `{scheme}` | {name} | {w:,} | {n} ({works} works) | {format_delta(d)} | {width:.2f} pp |"
                )
                print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Interval width at equal words read: the main job's documents against the audit's passages",
            "",
            f"Command: `python benchmarks/passage_width.py --out {args.out}`; SmolLM2-135M in bfloat16; what the "
            "columns mean and the success criterion: the module docstring of benchmarks/passage_width.py.",
            "",
            "| scheme | set | words read (at least) | units | change [95% CI] | interval width |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
