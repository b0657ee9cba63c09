"""The "Which fix?" section of a study report (``report: fixes``): every scheme of the study set against
one reference scheme (the broken one), per model, ranked by the perplexity change it causes.

A scheme *fixes* a model when its whole 95% interval lies below ``within`` (default +1%), *does not* when the
whole interval lies at or above it; one whose interval straddles it, or is approximate, is "not resolved"; all rank
by estimate. A model read in bfloat16 is judged by the same rule: its change is measured in bfloat16 for the float
model and the scheme alike, paired, with log-probabilities in float32 (issue 54 measured bf16 minus float32 on
weight-only INT8's change at +0.03 pp [-0.13, +0.22]: no declared margin stands in for that measurement).
Costs: the parameters a scheme keeps in full precision or adds (``keep=auto``, a rotation's folded
biases), the extra run-time operations per token (the online Hadamard transforms), the range kind
(static ranges cost nothing at run time; per-token, per-block and LLM.int8's outlier split each
read every activation), and the measured quantization time (calibration included).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..quant.schemes import get_scheme
from ..stats import MIN_CLUSTERS, Delta, format_delta, paired_delta, table_head, table_row
from .measures import ppl_key
from .records import CellRecord, Fixes

__all__ = [
    "which_fix",
    "fix_rows",
    "FixRow",
    "range_kind",
    "without_sink",
    "sink_effect",
    "verdict",
    "Verdict",
]

Changes = dict[tuple[str, str], "Delta | None"]  # {(cell id, scheme): its perplexity change}


def range_kind(scheme: str) -> str:
    """Where a scheme's activation scales come from, in words (its class says: :meth:`Scheme.range_kind`)."""
    return get_scheme(scheme).range_kind()


def _sink_tokens(scheme: str) -> int:
    return get_scheme(scheme).kv_sink


def without_sink(scheme: str) -> str | None:
    """The scheme with its KV-cache sink tokens quantized too, or None where it keeps none."""
    other = get_scheme(scheme).without_sink()
    return None if other is None else str(other)


def sink_effect(cell: CellRecord, base: str, kept: str) -> Delta | None:
    """The perplexity change from ``base`` to ``kept`` (the same scheme keeping the sink tokens), paired over the
    documents both read; None where either kept no per-document values."""
    key = ppl_key(cell)
    if key is None:
        return None
    docs_base, docs_kept = (cell.scheme(s).documents.get(key[0]) for s in (base, kept))
    return paired_delta(docs_base, docs_kept, key[1], cluster=cell.cluster) if docs_base and docs_kept else None


def _why_no_interval(d: Delta) -> str:
    """Why ``d`` (approximate, or without an interval) decides nothing, from its method."""
    units = f"{d.n} documents" + (f" in {d.clusters} independent units" if d.clusters is not None else "")
    if d.approximate:
        return f"its intervals are approximate ({units}; fewer than {MIN_CLUSTERS})"
    return f"no interval ({units})"


class Verdict(str, Enum):
    """What a scheme's change says against the threshold (:func:`verdict`); a ``str``, so it reads, compares and
    serializes as its words ("fixed", "not fixed", "not resolved", "not run")."""

    FIXED = "fixed"
    NOT_FIXED = "not fixed"
    NOT_RESOLVED = "not resolved"
    NOT_RUN = "not run"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def verdict(d: Delta | None, within: float) -> Verdict:
    """``FIXED`` (the whole interval below ``within``), ``NOT_FIXED`` (the whole interval at or above it),
    ``NOT_RESOLVED`` (the interval straddles ``within``, or has no verdict to give: approximate or absent), or
    ``NOT_RUN``."""
    if d is None:
        return Verdict.NOT_RUN
    if not d.decisive:
        return Verdict.NOT_RESOLVED
    assert d.low is not None and d.high is not None
    if d.high < within:
        return Verdict.FIXED
    return Verdict.NOT_FIXED if d.low >= within else Verdict.NOT_RESOLVED


@dataclass(frozen=True)
class FixRow:
    """A scheme on one model: its perplexity change, verdict (fixed, not resolved, not fixed) and costs: the
    parameters it keeps in (or adds at) full precision, the operations per token it adds, its quantize time."""

    scheme: str
    delta: Delta
    verdict: Verdict
    params: int
    ops: int
    seconds: float | None


def fix_rows(cell: CellRecord, schemes: list[str], changes: Changes, within: float) -> list[FixRow]:
    """One row per scheme evaluated on ``cell``, best (smallest change) first."""
    rows = []
    for s in schemes:
        r = cell.scheme(s)
        d = changes.get((cell.id, s))
        if d is None:
            continue
        m = r.mitigation
        rows.append(
            FixRow(
                scheme=s,
                delta=d,
                verdict=verdict(d, within),
                params=m.extra_params if m else 0,
                ops=m.extra_ops_per_token if m else 0,
                seconds=r.quantize_s,
            )
        )
    return sorted(rows, key=lambda row: row.delta.value)


def which_fix(
    cells: list[CellRecord],
    schemes: list[str],
    changes: Changes,
    fixes: Fixes,
    pairs: list[list[str]],
) -> list[str]:
    """The report's opening section (module docstring)."""
    reference, within = str(get_scheme(fixes.reference)), fixes.within
    lines = [
        "## Which fix?",
        "",
        f"Each scheme against `{reference}` (the reference) on every model: a scheme *fixes* a model when "
        f"its whole 95% interval lies below +{within:.0%} of the float perplexity, and does not when the whole "
        f"interval lies at or above it; *not resolved* when the interval straddles +{within:.0%} or is "
        "approximate.",
        "",
    ]
    by_model: dict[str, CellRecord] = {}
    for c in cells:
        by_model.setdefault(c.model, c)
    rows_of = {m: fix_rows(c, schemes, changes, within) for m, c in by_model.items()}
    for model, c in by_model.items():
        ref = changes.get((c.id, reference))
        lines.append(_model_line(model, c, rows_of[model], reference, ref, within))
    lines += _twin_lines(pairs, rows_of, within)
    lines += _sink_lines(schemes, by_model)
    order = [r.scheme for r in next(iter(rows_of.values()))]
    order += [s for s in schemes if s not in order]
    lines += _change_table(order, by_model, changes, within)
    lines += _cost_table(order, rows_of)
    return [*lines, "", "Plot: study_fixes.png.", ""]


def _model_line(model: str, c: CellRecord, rows: list[FixRow], reference: str, ref: Delta | None, within: float) -> str:
    """One model's verdicts: the reference's change, the schemes that fix it (best first), those not resolved."""
    fixed = [r for r in rows if r.verdict is Verdict.FIXED and r.scheme != reference]
    unresolved = [r for r in rows if r.verdict is Verdict.NOT_RESOLVED and r.scheme != reference]
    text = f"- **{model}** ({c.variant}): `{reference}` {format_delta(ref)}"
    if ref is not None and not ref.decisive:
        return f"{text}; no verdicts: {_why_no_interval(ref)}."
    if verdict(ref, within) is Verdict.FIXED:
        text += f", already within +{within:.0%}: it needs no fix."
    elif fixed:
        text += (
            f"; fixed by {len(fixed)} of {len(rows) - 1}, best first: "
            + ", ".join(f"`{r.scheme}` {format_delta(r.delta)}" for r in fixed)
            + "."
        )
    else:
        text += f"; no scheme here brings it within +{within:.0%}."
    if unresolved:
        text += " Not resolved: " + ", ".join(f"`{r.scheme}` {format_delta(r.delta)}" for r in unresolved) + "."
    return text


def _twin_lines(pairs: list[list[str]], rows_of: dict[str, list[FixRow]], within: float) -> list[str]:
    """Per pair of twins in the study: how many schemes keep each within the threshold, and those only the gated
    twin's."""
    lines = []
    for ungated, gated in pairs:
        if ungated in rows_of and gated in rows_of:
            fixed_u, fixed_g = ([r.scheme for r in rows_of[m] if r.verdict is Verdict.FIXED] for m in (ungated, gated))
            only_g = [s for s in fixed_g if s not in fixed_u]
            lines.append(
                f"- **{gated}** vs its ungated twin **{ungated}**: {len(fixed_g)} vs {len(fixed_u)} of the "
                f"schemes keep them within +{within:.0%}"
                + ("; only the gated twin: " + ", ".join(f"`{s}`" for s in only_g) if only_g else "")
                + "."
            )
    return lines


def _sink_lines(schemes: list[str], by_model: dict[str, CellRecord]) -> list[str]:
    """Per scheme that keeps KV-cache sink tokens, beside the same scheme without them: the paired change."""
    lines = []
    for s in schemes:
        base = without_sink(s)
        if base is not None and base in schemes:
            effects = [
                f"{format_delta(sink_effect(c, base, s))} on {m}"
                for m, c in by_model.items()
                if base in c.schemes and s in c.schemes
            ]
            lines.append(
                f"- KV cache: keeping its first {_sink_tokens(s)} token(s) in full precision (`{s}` "
                f"against `{base}`, paired over the same documents) changes the perplexity by "
                + ", ".join(effects)
                + "."
            )
    return lines


def _change_table(order: list[str], by_model: dict[str, CellRecord], changes: Changes, within: float) -> list[str]:
    """The change of perplexity per scheme (rows, in ``order``) and model (columns), fixes marked."""
    lines = [
        "",
        "Change of perplexity per model (rows: schemes, best on the first model first; ~: within noise):",
        "",
        *table_head(["scheme", "range kind", *by_model]),
    ]
    for s in order:
        cols = [
            format_delta(changes.get((c.id, s)))
            + (" **fixed**" if verdict(changes.get((c.id, s)), within) is Verdict.FIXED else "")
            for m, c in by_model.items()
        ]
        lines.append(table_row([f"`{s}`", range_kind(s), *cols]))
    return lines


def _cost_table(order: list[str], rows_of: dict[str, list[FixRow]]) -> list[str]:
    """What each scheme costs per model: full-precision parameters, run-time operations, time to quantize."""
    head = [
        "scheme",
        *[f"{m}: {x}" for m in rows_of for x in ("extra full-precision params", "extra ops / token", "quantize s")],
    ]
    lines = [
        "",
        "Cost: parameters kept in (or added at) full precision, run-time operations per token that "
        "the mitigation adds (the online Hadamard transforms; static ranges add none, dynamic ones read "
        "each activation: see the range kind), and the time to quantize (calibration included) on this "
        "machine. Forward-time ratios: benchmarks/quant_speed.py.",
        "",
        *table_head(head),
    ]
    costs = {m: {r.scheme: r for r in rows} for m, rows in rows_of.items()}
    for s in order:
        cols = []
        for m in rows_of:
            r = costs[m].get(s)
            cols += (
                ["-", "-", "-"]
                if r is None
                else [f"{r.params:,}", f"{r.ops:,}", "-" if r.seconds is None else f"{r.seconds:.1f}"]
            )
        lines.append(table_row([f"`{s}`", *cols]))
    return lines
