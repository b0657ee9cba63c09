"""Does a gate trained from scratch make per-tensor static INT8 work where its ungated baseline breaks? Qiu et al.'s
released Qwen3 pair (baseline and gate_headwise or gate_elementwise), audited as a pair.

    python experiments/qiu_gate_pair.py BASELINE GATED [--out results/qiu_gate_pair] [--budget 60m]
    python experiments/qiu_gate_pair.py --smoke --out /tmp/x      # the packaged twins, one passage per work

BASELINE and GATED: the two checkpoints as folders or hub ids already in the local Hugging Face cache (nothing is
downloaded); quantgate loads Qiu et al.'s gated layout (gate rows inside q_proj, a config switch) as its G1 gate.
The command is `quantgate audit BASELINE --against GATED --schemes w8a8-int8-static`: both models read the same
held-out passages with the same calibration, and the gate's effect is the gated model's change minus the
baseline's, paired over those passages.

Criterion, declared before any run (issue 56), on per-tensor static W8A8 (`w8a8-int8-static`), every interval
decisive (not approximate):

* **confirmed**: the baseline breaks (its change's interval at or above +10%), the gated model does not (at or
  below +2%), and the paired difference lies wholly below 0. The issue's "at least 5x smaller" follows from the
  first two (a change of at most +2% against one of at least +10%), so it is no separate test: a rule with a
  clause that cannot fail would only look stricter;
* **refuted**: both break (both intervals at or above +10%) and their changes are within a factor of 2;
* otherwise **no verdict**, naming the part that failed (among them: the baseline does not break, so there is
  nothing for the gate to fix, which is no evidence either way).

Writes OUT/audit.md and audit.json (the audit's) and OUT/verdict.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import quantgate as qg
from quantgate.audit.record import PairRecord
from quantgate.files import write_text_atomic
from quantgate.stats import format_delta

SCHEME = "w8a8-int8-static"
BREAKS, HOLDS, TIE = 0.10, 0.02, 2.0  # the criterion above


def verdict(row: PairRecord) -> str:
    """The declared criterion read off one scheme's pair record: "confirmed", "refuted" or "no verdict: why"."""
    b, g, d = row.baseline, row.gated, row.difference
    if b is None or g is None or d is None or None in (b.low, g.low, d.high, b.high, g.high):
        return "no verdict: an interval is missing"
    if b.approximate or g.approximate or d.approximate:
        return "no verdict: an interval is approximate"
    assert b.low is not None and g.low is not None and g.high is not None and d.high is not None
    if b.low >= BREAKS and g.low >= BREAKS:
        if max(b.value, g.value) <= TIE * min(b.value, g.value):
            return "refuted: both break, within a factor of 2 of each other"
        return "no verdict: both break, but not within a factor of 2"
    if b.low < BREAKS:
        return "no verdict: the baseline does not break under static INT8 (nothing for the gate to fix)"
    if g.high > HOLDS:
        return "no verdict: the gated model's change is not shown to be at most +2%"
    if d.high >= 0:
        return "no verdict: the paired difference is not wholly below 0"
    return "confirmed: the baseline breaks, the gated model holds, and the gate removes at least four-fifths"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baseline", nargs="?", help="the ungated checkpoint (folder or cached hub id)")
    ap.add_argument("gated", nargs="?", help="its gated counterpart")
    ap.add_argument("--out", default="results/qiu_gate_pair")
    ap.add_argument("--budget", default="60m")
    ap.add_argument("--smoke", action="store_true", help="the packaged twins, one passage of each work")
    args = ap.parse_args(argv)
    if args.smoke:
        baseline, gated, docs, budget = "twin-vanilla", "twin-g1", 1, "1h"
    elif args.baseline and args.gated:
        baseline, gated, docs, budget = args.baseline, args.gated, None, args.budget
    else:
        sys.exit("give BASELINE and GATED (folders or hub ids in the local cache), or --smoke")
    found = qg.audit(baseline, args.out, against=gated, schemes=[SCHEME], docs=docs, budget=budget)
    (row,) = [r for r in found.record.pair if r.scheme == SCHEME]
    reading = verdict(row)
    lines = [f"# {gated} against {baseline} under `{SCHEME}`", "", f"**{reading}**", ""]
    lines += [f"- {name}: {format_delta(change.delta(kind) if change else None)}" for name, change, kind in (
        (f"{baseline} (baseline)", row.baseline, "perplexity"), (f"{gated} (gated)", row.gated, "perplexity"),
        ("gated minus baseline, paired", row.difference, row.kind))]  # fmt: skip
    lines += [
        "",
        f"Criterion and command: experiments/qiu_gate_pair.py, declared before any run. Audit: {args.out}/audit.md",
    ]
    text = "\n".join(lines) + "\n"
    write_text_atomic(Path(args.out) / "verdict.md", text)
    print(text, end="")


if __name__ == "__main__":
    main()
