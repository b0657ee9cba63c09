"""audit.md: the answer first (static INT8 or not, the certified recipe, why), then every candidate tried."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..certify import Test, certifies
from ..stats import Delta, format_delta, table_head, table_row
from .plan import duration
from .record import AuditRecord
from .search import LADDER, REFERENCE, Candidate, Found, Work, serves
from .target import Target

if TYPE_CHECKING:
    from ..observe import ObserveReport

__all__ = ["text", "LOADERS"]

LOADERS = {"clm": "AutoModelForCausalLM", "mlm": "AutoModelForMaskedLM"}
WORDS = {Work.STATIC: "static ranges: nothing read at run time", Work.TOKEN: "every token's range read at run time",
         Work.ROTATION: "per-token ranges and online Hadamard transforms"}  # fmt: skip


def _cost(c: Candidate) -> str:
    kept = f", {c.cost.kept} Linears ({c.cost.kept_share:.1%} of the weights) kept in 16-bit" if c.cost.kept else ""
    bits = f"weights at {c.cost.weight_bits:.2f} bits, matmuls at {c.cost.compute_bits:.2f} bits"
    return f"{bits}{kept}; {WORDS[c.cost.work]}"


def percent(fraction: float) -> str:
    """A tolerance as a percentage with the digits it needs: ``1.00%``, ``0.50%``, and ``1e-07%`` for --within 1e-9
    (never ``0.00%`` for a tolerance above 0: the page restates the question as the user asked it)."""
    p = fraction * 100
    return f"{p:.2f}%" if p >= 0.01 and abs(round(p, 2) - p) <= 1e-9 * p else f"{p:.3g}%"


def _static_line(name: str, static: Delta | None, tolerance: float, docs: str = "documents") -> str:
    head = f"- **Per-tensor static INT8**: {name}"
    if static is None:
        return f"{head}: not evaluated (cut by the budget)."
    said = (
        f"perplexity {format_delta(static)} on the search {docs} (95% interval; the tolerance is +{percent(tolerance)})"
    )
    if certifies(static, tolerance):
        return f"{head} survives it: {said}."
    if static.decisive and static.low is not None and static.low >= tolerance:
        return f"{head} does not survive it: {said}."
    return f"{head}: not resolved: {said}."


def _recipe_lines(found: Found, tests: list[Test], tolerance: float, record: AuditRecord,
                  docs: str = "documents") -> list[str]:  # fmt: skip
    by = {c.scheme: c for c in found.candidates}
    if record.recipe is not None:
        c = by[record.recipe]
        lines = [
            f"- **Recipe**: `{_short(c)}`, certified: on held-out {docs} the search never read, computed in "
            f"float32 from the same quantized state, perplexity {format_delta(c.held_out)}, wholly below "
            f"+{percent(tolerance)} ({_cost(c)}; on the search {docs} {format_delta(c.search)})."
        ]
    else:
        within = [c for c in found.candidates if c.search is not None and c.search.value < tolerance]
        best = min(found.candidates, key=lambda c: c.search.value if c.search else float("inf"), default=None)
        if not within:
            tail = f"; the least change: `{_short(best)}` {format_delta(best.search)}" if best else ""
            lines = [f"- **Recipe**: none of the {len(found.candidates)} tried changes the perplexity by less than "
                     f"+{percent(tolerance)} on the search {docs}{tail}."]  # fmt: skip
        else:
            failed = tests[-1] if tests else None
            served = [c for c in within if serves(c.scheme, record.serve)]
            if failed:
                why = f"`{_short(by[failed.name])}` reads {format_delta(failed.delta)} on the held-out {docs}"
            elif not served:
                why = f"none of those within on the search {docs} is served by {record.serve} (--serve)"
            else:
                why = f"the budget left no time for the held-out {docs}"
            more = "documents" if docs == "documents" else "batches"
            lines = [f"- **Recipe**: none certified: {why}; {len(within)} had a change below +{percent(tolerance)} on "
                     f"the search {docs}; a larger --budget reads more {more}."]  # fmt: skip
    runners = [t for t in tests if t.certified and t.name != record.recipe]
    if runners:
        lines.append(
            "- **Also certified** (costlier): "
            + "; ".join(f"`{_short(by[t.name])}` {format_delta(t.delta)}" for t in runners)
            + "."
        )
    return lines


def _short(c: Candidate | None) -> str:
    """A recipe's scheme, with a long keep= list shortened to its count (audit.json holds every name)."""
    if c is None:
        return "-"
    if not c.kept:
        return c.scheme
    return f"{c.base} + {len(c.kept)} Linears kept in 16-bit"


def _block(name: str) -> tuple[int | None, str]:
    found = re.search(r"\.(\d+)\.(.+)$", name)
    return (int(found.group(1)), found.group(2)) if found else (None, name)


def _fallback_lines(found: Found, record: AuditRecord, report: ObserveReport | None,
                    docs: str = "documents") -> list[str]:  # fmt: skip
    lines = []
    for f in found.fallbacks:
        ks = [k for k, d in f.tried.items() if d is not None]
        chosen = next((c for c in found.candidates if c.base == f.base and c.kept), None)
        if chosen is None:
            total = len(f.sites.linears)
            lines.append(f"- **Per-site fallback of `{f.base}`**: no number of its {total} Linears kept in "
                         f"16-bit brought it within in the time ({len(ks)} tried).")  # fmt: skip
            continue
        kinds: dict[str, int] = {}
        for n in chosen.kept:
            kinds[_block(n)[1]] = kinds.get(_block(n)[1], 0) + 1
        top = ", ".join(f"`{n}`" for n in chosen.kept[:5])
        lines.append(
            f"- **Per-site fallback of `{f.base}`**: {len(chosen.kept)} of its {len(f.sites.linears)} Linears kept "
            "in 16-bit "
            f"(ranked by {f.method}: {', '.join(f'{v} {k}' for k, v in sorted(kinds.items(), key=lambda x: -x[1]))})"
            f" give {format_delta(chosen.search)} on the search {docs}; the costliest: {top}."
            + _massive_note(chosen.kept, report)
        )
    if record.curve:
        points = "; ".join(
            f"+{p.tolerance:.0%}: {p.kept if p.kept is not None else 'not found'}"
            + (f" ({_change(p.change)})" if p.change else "")
            for p in record.curve
        )
        lines.append(f"- **Static INT8, tolerance against the fewest Linears kept**: {points}.")
    return lines


def _change(c) -> str:
    return format_delta(c.delta())


def _massive_note(kept: tuple[str, ...], report: ObserveReport | None) -> str:
    """Where the massive activations sit, beside the blocks of the kept sites."""
    top = getattr(report.summary, "top_massive", None) if report is not None else None
    if not top:
        return ""
    blocks = {_block(n)[0] for n in kept}
    hits = [t for t in top if t.layer in blocks]
    if not hits:
        return ""
    t = hits[0]
    where = ", ".join(str(p[0]) for p in t.positions[:3])
    return (f" Block {t.layer}, one of the kept, writes the model's massive activations (channel {t.channel}, "
            f"token position(s) {where}).")  # fmt: skip


def _why(report: ObserveReport | None) -> list[str]:
    if report is None:
        return []
    s = report.summary
    parts = []
    if s.max_activation is not None:
        parts.append(f"largest residual activation {s.max_activation:.4g}")
    if s.max_median_ratio:
        parts.append(f"{s.max_median_ratio:.4g}x its block's median |x|")
    if s.sink_mass is not None:
        parts.append(f"mean first-token attention {s.sink_mass:.2f}")
    if s.gate_mean is not None:
        parts.append(f"mean gate {s.gate_mean:.3g}")
    massive = f"{s.massive_activations} massive activations" if s.massive_activations else "no massive activations"
    return [f"- **Outlier profile** (float model, 3 held-out batches): {massive}; " + "; ".join(parts) + "."]


def _table(found: Found, tolerance: float) -> list[str]:
    head = ["recipe", "weight / matmul bits", "kept in 16-bit", "run-time work", "search change [95% CI]",
            "held-out change [95% CI] (float32)", "certified", "s"]  # fmt: skip
    lines = table_head(head)
    for c in sorted(found.candidates, key=lambda c: c.cost.key()):
        verdict = "yes" if certifies(c.held_out, tolerance) else ("no" if c.held_out is not None else "-")
        lines.append(table_row([
            f"`{_short(c)}`", f"{c.cost.weight_bits:.2f} / {c.cost.compute_bits:.2f}",
            f"{c.cost.kept} ({c.cost.kept_share:.1%})" if c.cost.kept else "-", WORDS[c.cost.work].split(":")[0],
            format_delta(c.search), format_delta(c.held_out), verdict, f"{c.seconds:.0f}",
        ]))  # fmt: skip
    return lines


def _load_lines(t: Target, export: Path, others: bool) -> list[str]:
    loader = LOADERS[t.family.objective]
    lines = [f'- quantgate: `import quantgate as qg; qg.load("{export}")`']
    if others:
        lines.append(f'- transformers: `from transformers import {loader}; {loader}.from_pretrained("{export}")`')
        if t.family.objective == "clm":
            lines.append(f"- vLLM: `vllm serve {export}` (on the CPU: docs/guides/serve-with-vllm.md)")
    return lines


def _pair_lines(record: AuditRecord, found: Found) -> list[str]:
    """On a pair, per whole-model scheme: each one's change and the gate's effect, the second's change minus the
    first's paired over the same sequences, with the share of the first's damage the second does not have."""
    if record.against is None:
        first, second, who = "the ungated twin", "the gated twin", "the gated twin's change minus the ungated twin's"
    else:
        first, second = f"`{record.model}`", f"`{record.against}`"
        who = f"{second}'s change minus {first}'s"
    lines = []
    for row in record.pair:
        one, two, gap = found.pairs[row.scheme]
        share = row.share_removed
        removed = "" if share is None else f"; {share:.0%} of {first}'s change removed"
        if share is not None and share < 0:
            removed = f"; {-share:.0%} added to {first}'s change"
        lines.append(
            f"- **The gate's effect** under `{row.scheme}`: {who}, paired over the same sequences: "
            f"{format_delta(gap)} ({first} {format_delta(one)}, {second} {format_delta(two)}{removed})."
        )
    return lines


def text(t: Target, record: AuditRecord, found: Found, tests: list[Test], tolerance: float, export: Path | None,
         note: str, seconds: float, budget_s: float) -> str:  # fmt: skip
    """audit.md's whole text."""
    static = next((c.search for c in found.candidates if c.scheme == REFERENCE), None)
    docs = t.reads.unit  # what the audit's sets hold: documents (passages of text), or sequences (batches of 16)
    lines = [f"# Audit of {t.name}", "", _static_line(t.name, static, tolerance, docs)]
    lines += _recipe_lines(found, tests, tolerance, record, docs)
    lines += _fallback_lines(found, record, found.report, docs)
    lines += _why(found.report)
    lines += _pair_lines(record, found)
    if found.cut:
        lines.append(f"- **Cut by the budget**: {', '.join(f'`{s}`' for s in found.cut)}.")
    lines += ["", f"Export: `{export}`, in {note}. Load it with:" if export else f"No export: {note}.", ""]
    if export:
        lines += [*_load_lines(t, export, not note.startswith("quantgate")), ""]
    lines += ["## Every recipe tried", "", *_table(found, tolerance), ""]
    ladder = ", ".join(f"`{r.scheme}`" for r in LADDER if not r.probe)
    cluster = "clustered by work" if docs == "documents" else "each sequence its own unit"
    lines.append(
        f"Search {docs}: {record.search_documents}; held-out {docs}: {record.held_out_documents}. Each change "
        f"is the perplexity under the recipe over the float model's on the same {docs}, with a 95% interval "
        f"paired over them ({cluster}). The search tries the whole-model schemes ({ladder}, then fewer bits) "
        f"and the per-site fallbacks in the audit's dtype ({record.dtype}); the recipes whose change there is "
        f"below +{percent(tolerance)} are tested in turn (whole-model ones first, the most confident there first, "
        f"then the fallbacks) on the held-out {docs} in "
        f"float32, until one fails; the recipe is the cheapest certified (fixed-sequence testing: certifying a "
        f"recipe whose true change is at or above the tolerance has a chance of at most 2.5%, however many were "
        f"tried). Cost: bits of the weights, then of the matmuls, then "
        f"run-time work ({', '.join(w.name.lower() for w in Work)}). "
        + (
            f"Serving target {record.serve}: only recipes it has kernels for were certified. "
            if record.serve != "any"
            else ""
        )
        + "Every name and number: audit.json. Audit time: "
        f"{seconds:.0f} s of a {duration(budget_s)} budget."
    )
    return "\n".join(lines) + "\n"
