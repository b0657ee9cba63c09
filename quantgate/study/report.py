"""A study's report.md and plots, rebuilt from its metrics.json alone (``quantgate report DIR``).

The page is :data:`SECTIONS`, in order. A section is a function ``(Report) -> str``: its markdown, or ``""``
where it has nothing to show (a study with one seed has no "Across seeds"). :class:`Report` is what every
section reads: the run (a :class:`~.records.StudyRecord`) and each cell's perplexity change under each scheme,
computed once. :func:`study_markdown` joins the sections' markdown with newlines.

A new section is one function here and its place in :data:`SECTIONS`. A section that draws a plot also adds it to
:func:`plot_files`: the one place that decides which plots a report has, which the "Plots" section lists and
:func:`study_plots` draws. ``quantgate compare`` of eval runs is :mod:`.compare`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..eval.tasks import PERPLEXITY_LEGEND
from ..files import write_text_atomic
from ..registry import Registry
from ..stats import DELTA_LEGEND, NOISE_LEGEND, fmt, format_delta, pearson, seed_delta, spearman, table_head, table_row
from . import compat
from .fixes import Changes, which_fix
from .measures import (
    BUDGET,
    accuracy_metrics,
    after_first,
    bit_sweeps,
    budget,
    change_gap,
    float_change,
    gap_reading,
    max_layer_sink,
    metric_of,
    peak_activation,
    ppl_change,
    ppl_of,
    read_on,
    scheme_change,
)
from .records import CellRecord, ReportSettings, StudyRecord, edit_metrics, read_metrics, record_cluster
from .report_plots import plot_bit_sweeps, plot_fixes, plot_study_layers, plot_study_quant, plot_study_training

__all__ = ["Report", "SECTIONS", "study_markdown", "study_plots", "plot_files", "write_study_report"]

MIN_CORRELATION_N = 5  # correlations across fewer cells are not printed
OUTLIER_LEGEND = (
    "Max inf-norm: per tensor, each sequence's max |x| averaged over sequences (Bondarenko et al.), the largest "
    "over their tensors. Max activation: the largest |x| of the residual stream (block outputs) over blocks; "
    "max / median: that block's max |x| over its median |x|, so that a smaller maximum at the same ratio reads as a "
    "smaller scale, not fewer outliers. Kurtosis: mu4 / sigma^4 (non-excess, Gaussian = 3) of each sequence's "
    "flattened tokens x channels tensor, averaged over sequences, then over Bondarenko et al.'s tensors (their "
    "reference code): for BERT each layer's FFN output and the LayerNorm output after it (the inf-norm adds that "
    "LayerNorm's input, the residual sum); for decoders each block's output, attention output, FFN output and the "
    "outputs of its two norms, and the final norm's output."
)
RATIO_NOTE = (
    "Where either perplexity grew 10x or more the difference is the ratio of the two perplexity ratios instead "
    "(printed 0.02x: the variant's ratio is a fiftieth of the other's; below 1x it loses less)."
)


@dataclass(frozen=True)
class Report:
    """What the sections read: the run, and ``changes``, each cell's perplexity change under each scheme
    (``{(cell id, scheme): Delta or None}``, :func:`.measures.ppl_change`)."""

    metrics: StudyRecord
    changes: Changes

    @classmethod
    def of(cls, metrics: StudyRecord) -> Report:
        return cls(metrics, {(c.id, s): ppl_change(c, s) for c in metrics.cells for s in metrics.schemes})

    @property
    def cells(self) -> list[CellRecord]:
        return self.metrics.cells

    @property
    def schemes(self) -> list[str]:
        return self.metrics.schemes

    @property
    def settings(self) -> ReportSettings:
        """The study's ``report:`` settings (criterion, fixes, pairs, baseline, notes)."""
        return self.metrics.report

    def markdown(self) -> str:
        """report.md: the sections in order, each left out where it has nothing to show."""
        return "\n".join(text for section in SECTIONS.values() if (text := section(self))).rstrip() + "\n"

    def draw(self, out: Path) -> None:
        """The report's plots (:func:`plot_files`), drawn into ``out``."""
        for name, draw in plot_files(self).items():
            draw(out / name)


def _run(cell: CellRecord) -> list[str]:
    """The seed and training tokens of a cell, for its table rows."""
    return [str(cell.seed), f"{cell.trained.tokens:,}" if cell.is_trained else "pretrained"]


def _cost(cell: CellRecord) -> list[str]:
    cost = cell.cost  # None in runs made before gate costs were recorded
    return [f"{cost.gate_params:,}", fmt(cost.gate_flops_per_token)] if cost else ["-", "-"]


# --- the sections, in the order of SECTIONS -------------------------------------------------------


def header(report: Report) -> str:
    """The study's name and description, how to reproduce the page, the machine and the compute."""
    metrics, st, m = report.metrics, report.metrics.settings, report.metrics.machine
    file = "<study.yaml>" if st.file is None else st.file
    return "\n".join(
        [
            f"# Study: {st.name}",
            "",
            st.description.strip(),
            "",
            f"Reproduce: `{('quantgate study ' + file).strip()}`; "
            "rebuild this page from metrics.json with `quantgate report <this directory>`.",
            f"Machine: {m.platform}, {m.cpus} CPUs ({m.torch_threads} torch threads); "
            + ", ".join(f"{k} {v}" for k, v in metrics.versions.items() if v)
            + ".",
            f"Compute: {metrics.wall_seconds.steps_total:.0f} s over all steps of all cells "
            f"({len(metrics.cells)} cells).",
            "",
        ]
    )


def criterion(report: Report) -> str:
    """The success criterion, declared in the study file before its runs (its git history shows when)."""
    text = report.settings.criterion.strip()
    if not text:
        return ""
    return "\n".join(["## Success criterion (from the study file, declared before the runs)", "", text, ""])


def fixes(report: Report) -> str:
    """Which fix? (``report: fixes``, :func:`.fixes.which_fix`)."""
    asked = report.settings.fixes
    if asked is None:
        return ""
    return "\n".join(which_fix(report.cells, report.schemes, report.changes, asked, report.settings.pairs))


def answer(report: Report) -> str:
    """The study's answer first: per [ungated, gated] pair of models (``report: pairs``), the first scheme the
    pair ran (in the ungated model's own order, ``own``: {model: its schemes}) with its paired difference, the
    activation-bit budgets and a table of every scheme paired; then each other model's changes."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    pairs = report.settings.pairs
    if not pairs:
        return ""
    own = {m.name: [e.scheme for e in m.schemes] for m in report.metrics.settings.models}
    first: dict[str, CellRecord] = {}
    for c in cells:
        first.setdefault(c.model, c)
    lines = ["## The answer", ""]
    for ungated, gated in pairs:
        u, g = first[ungated], first[gated]
        scheme = next(
            (s for s in own.get(ungated) or schemes if changes.get((u.id, s)) and changes.get((g.id, s))), None
        )
        if scheme is None:  # no scheme evaluated on both
            continue
        du, dg = changes[u.id, scheme], changes[g.id, scheme]
        gap = change_gap(u, g, scheme)

        def about(c):
            (sink, layer), (_, ratio) = max_layer_sink(c), peak_activation(c)
            return f"first-token attention up to {sink:.2f} (layer {layer}), max / median {fmt(ratio)}"

        text = (
            f"- **{ungated}** (ungated; {about(u)}) changes by {format_delta(du)} under `{scheme}`, its gated "
            f"twin **{gated}** ({about(g)}) by {format_delta(dg)}; paired over the same documents, the gated "
            f"twin's change minus the ungated one's is {format_delta(gap)}: {gap_reading(gap, 'the gated twin')}."
        )
        first_prediction = change_gap(u, g, scheme, after_first())
        if first_prediction is not None:
            text += (
                " Without the first prediction (the random token after BOS) the paired difference is "
                f"{format_delta(first_prediction)}."
            )
        for base, points in bit_sweeps(schemes).items():
            budgets = [budget([(b, changes.get((c.id, s))) for b, s in points]) for c in (u, g)]
            text += (
                f" Activation-bit budget (`{base}`, +{BUDGET:.0%}): "
                + " vs ".join(f"A{f[0]}" if f else "none" for f in budgets)
                + "; "
                + "; ".join(
                    f"A{b}: {format_delta(changes.get((u.id, s)))} vs {format_delta(changes.get((g.id, s)))} "
                    f"(paired difference {format_delta(change_gap(u, g, s))})"
                    for b, s in points[1:]
                )
                + "."
            )
            for task_metric in (t for t in accuracy_metrics() if metric_of(u.float_results, t) is not None):
                text += (
                    f" {task_metric[1]} ({task_metric[0]}): "
                    + "; ".join(
                        f"A{b} {format_delta(scheme_change(u, s, task_metric))} vs "
                        f"{format_delta(scheme_change(g, s, task_metric))}"
                        for b, s in points
                    )
                    + "."
                )
        lines.append(text)
    for ungated, gated in pairs:
        lines += _pair_table(first[ungated], first[gated], schemes, changes)
    paired = {m for p in pairs for m in p}
    for model, c in first.items():
        if model not in paired:
            moved = [f"{format_delta(changes[c.id, s])} under `{s}`" for s in schemes if changes.get((c.id, s))]
            peak, ratio = peak_activation(c)
            lines.append(
                f"- **{model}** ({c.variant}; largest residual activation {fmt(peak)}, max / median "
                f"{fmt(ratio)}): " + "; ".join(moved) + "."
            )
    return "\n".join([*lines, ""])


def _pair_table(u: CellRecord, g: CellRecord, schemes: list[str], changes: Changes) -> list[str]:
    """Every scheme both twins ran, side by side: each one's change, the paired difference of the changes (the
    decision) and, on backcopy, the same without the first prediction."""
    both = [s for s in schemes if changes.get((u.id, s)) and changes.get((g.id, s))]
    after = any(change_gap(u, g, s, after_first()) is not None for s in both)
    head = ["scheme", f"{u.model} change", f"{g.model} change", "paired difference", "reading"]
    if after:
        head.insert(4, "paired, without the first prediction")
    lines = [
        "",
        f"Every scheme on **{u.model}** and **{g.model}**, the gated twin's change minus the ungated one's paired "
        f"over the same documents. {RATIO_NOTE}",
        "",
        *table_head(head),
    ]
    for s in both:
        gap = change_gap(u, g, s)
        row = [f"`{s}`", format_delta(changes[u.id, s]), format_delta(changes[g.id, s]), format_delta(gap)]
        if after:
            row.append(format_delta(change_gap(u, g, s, after_first())))
        lines.append(table_row([*row, gap_reading(gap, "the gated twin")]))
    return [*lines, ""]


def numbers(report: Report) -> str:
    """What the numbers show: a sentence per cell (its activations, sinks and gate; its perplexity per scheme)."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    lines = ["## What the numbers show", ""]
    for c in cells:
        s = c.summary
        peak, ratio = peak_activation(c)
        massive = s.massive_activations
        where = ""
        if s.top_massive:
            top = s.top_massive[0]
            where = (
                f" (largest: channel {top.channel} in layer {top.layer}, at token positions "
                f"{[p for p, _ in top.positions]})"
            )
        gate = f"; mean gate {fmt(s.gate_mean)}" if s.gate_mean is not None else ""
        text = (
            f"- **{c.model} / {c.variant}**: largest residual activation {fmt(peak)} "
            f"({fmt(ratio)} x its block's median), {massive} massive activations by Sun et al.'s criterion"
            f"{where}; mean first-token attention {fmt(s.sink_mass)}{gate}."
        )
        fp = ppl_of(c.float_results)
        moves = []
        for sch in schemes:
            q = ppl_of(c.scheme(sch).results)
            if q is not None and fp is not None:
                moves.append(f"{sch} {fmt(fp)} -> {fmt(q)} ({format_delta(changes[c.id, sch])})")
        if moves:
            text += " Perplexity: " + "; ".join(moves) + "."
        lines.append(text)
    return "\n".join([*lines, ""])


def outliers(report: Report) -> str:
    """Bondarenko et al.'s table: each cell's outliers and sinks, and each scheme's perplexity and change."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    head = [
        "model",
        "variant",
        "seed",
        "tokens trained",
        "FP ppl",
        "documents (clusters)",
        "max inf-norm",
        "max activation",
        "max / median",
        "kurtosis",
        "sink mass",
        "gate mean",
    ]
    for s in schemes:
        head += [f"{s} ppl", "change [95% CI]"]
    lines = [
        "## Outliers, sinks and quantized perplexity (Bondarenko et al.'s table)",
        "",
        PERPLEXITY_LEGEND + "; sink mass is the mean attention on the first token. All rows ran on the machine above.",
        "",
        OUTLIER_LEGEND,
        "",
        DELTA_LEGEND,
        "",
        *table_head(head),
    ]
    for c in cells:
        summ = c.summary
        row = [
            c.model,
            c.variant,
            *_run(c),
            fmt(ppl_of(c.float_results)),
            read_on(c),
            fmt(summ.max_inf_norm),
            *map(fmt, peak_activation(c)),
            fmt(summ.kurtosis),
            fmt(summ.sink_mass),
            fmt(summ.gate_mean),
        ]
        for sch in schemes:
            r = c.scheme(sch)
            row += [fmt(ppl_of(r.results)) if r.error is None else "n/a", format_delta(changes[c.id, sch])]
        lines.append(table_row(row))
    return "\n".join(lines)


def across_seeds(report: Report) -> str:
    """Per model and variant trained with several seeds: the perplexity change averaged over the seeds
    (:func:`stats.seed_delta`: geometric mean of the ratios), with a t-interval across them."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    by: dict[tuple[str, str], list[CellRecord]] = {}
    for c in cells:
        by.setdefault((c.model, c.variant), []).append(c)
    groups = {k: g for k, g in by.items() if len(g) > 1}
    if not groups:
        return ""
    head = ["model", "variant", "seeds", "FP ppl (mean)"] + [
        f"{s} change, geometric mean [95% t-interval]" for s in schemes
    ]
    lines = [
        "",
        "## Across seeds",
        "",
        "Each seed's perplexity ratio from the table above, averaged geometrically "
        "over the seeds, with a 95% Student t-interval on the log ratios across the seeds (seed-to-seed "
        "spread; the per-seed intervals are over documents). " + NOISE_LEGEND + ".",
        "",
        *table_head(head),
    ]
    for (model, variant), group in groups.items():
        fp = [v for c in group if (v := ppl_of(c.float_results)) is not None]
        row = [model, variant, ", ".join(str(c.seed) for c in group), fmt(sum(fp) / len(fp) if fp else None)]
        for s in schemes:
            deltas = [d for c in group if (d := changes[c.id, s]) is not None]
            row.append(format_delta(seed_delta([d.value for d in deltas], deltas[0].kind)) if deltas else "-")
        lines.append(table_row(row))
    return "\n".join(lines)


def bit_budget(report: Report) -> str:
    """Per sweep of activation widths (:func:`.measures.bit_sweeps`): each cell's fewest bits within BUDGET."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    sweeps = bit_sweeps(schemes)
    if not sweeps:
        return ""
    lines = [
        "## Bit budget",
        "",
        f"The fewest activation bits at which the perplexity increase stays under {BUDGET:.0%} (at that width "
        f"and every wider one), with the increase and its interval there; the sweep's changes beside it. A "
        f"budget whose interval reaches past {BUDGET:.0%} is not resolved by this evaluation. Plot: "
        f"study_bits.png.",
        "",
    ]
    for base, points in sweeps.items():
        head = ["model", "variant", "seed", "budget", *[f"A{b}" for b, _ in points]]
        lines += [f"`{base}`:", "", *table_head(head)]
        for c in cells:
            deltas = [(b, changes.get((c.id, sch))) for b, sch in points]
            found = budget(deltas)
            text = f"A{found[0]}: {format_delta(found[1])}" if found else f"none (A{points[0][0]} already over)"
            lines.append(
                "| "
                + " | ".join([c.model, c.variant, *_run(c)[:1], text, *[format_delta(d) for _, d in deltas]])
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def accuracy(report: Report) -> str:
    """The bundled accuracy tasks a cell was evaluated on: float accuracy, and each scheme's and its change."""
    cells, schemes = report.cells, report.schemes
    acc_rows = [(c, t) for t in accuracy_metrics() for c in cells if metric_of(c.float_results, t) is not None]
    if not acc_rows:
        return ""
    head = ["model", "variant", "seed", "task", "FP acc"] + [x for s in schemes for x in (f"{s} acc", "change")]
    lines = [
        "",
        "## Accuracy (bundled tasks)",
        "",
        "Change in percentage points, with its 95% paired interval over the items (as above); " + NOISE_LEGEND + ".",
        "",
        *table_head(head),
    ]
    for c, t in acc_rows:
        row = [c.model, c.variant, str(c.seed), t[0], fmt(metric_of(c.float_results, t))]
        for s in schemes:
            row += [fmt(metric_of(c.scheme(s).results, t)), format_delta(scheme_change(c, s, t))]
        lines.append(table_row(row))
    return "\n".join(lines)


def gates(report: Report) -> str:
    """Qiu et al.'s table: each cell's gate, activations and sinks, float perplexity and the gate's cost."""
    head = [
        "model",
        "variant",
        "seed",
        "tokens trained",
        "mean gate",
        "max activation",
        "max / median",
        "first-token attention",
        "FP ppl",
        "gate params",
        "gate FLOPs / token",
    ]
    lines = [
        "",
        "## Gate, activations and sinks (Qiu et al.'s table)",
        "",
        *table_head(head),
    ]
    for c in report.cells:
        summ = c.summary
        lines.append(
            "| "
            + " | ".join(
                [
                    c.model,
                    c.variant,
                    *_run(c),
                    fmt(summ.gate_mean),
                    *map(fmt, peak_activation(c)),
                    fmt(summ.sink_mass),
                    fmt(ppl_of(c.float_results)),
                    *_cost(c),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def correlations(report: Report) -> str:
    """Spearman / Pearson between every two quantities across cells, where at least MIN_CORRELATION_N
    cells have both."""
    qs = [_quantities(c, report.schemes, report.changes) for c in report.cells]
    lines = [
        "",
        f"Correlations across cells (Spearman / Pearson; n = cells with both numbers; omitted below "
        f"n = {MIN_CORRELATION_N}):",
        "",
    ]
    names = list(qs[0]) if qs else []
    rows = []
    for a in names:
        row = [a]
        for b in names:
            pairs = [(q[a], q[b]) for q in qs if q.get(a) is not None and q.get(b) is not None]
            if a == b or len(pairs) < MIN_CORRELATION_N:
                row.append("-")
                continue
            x, y = [p[0] for p in pairs], [p[1] for p in pairs]
            row.append(f"{fmt(spearman(x, y))} / {fmt(pearson(x, y))} (n={len(pairs)})")
        rows.append(row)
    if all(v == "-" for row in rows for v in row[1:]):
        return "\n".join([*lines, f"None: fewer than {MIN_CORRELATION_N} cells have any two of the numbers."])
    return "\n".join(
        lines + ["| | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)] + [table_row(row) for row in rows]
    )


def _quantities(cell: CellRecord, schemes: list[str], changes: Changes) -> dict:
    s = cell.summary
    peak, ratio = peak_activation(cell)
    out = {
        "gate mean": s.gate_mean,
        "sink mass": s.sink_mass,
        "max activation": peak,
        "max / median": ratio,
        "FP ppl": ppl_of(cell.float_results),
    }
    for scheme in schemes:
        d = changes[cell.id, scheme]
        out[f"ppl increase {scheme}"] = d.value if d is not None else None
    return out


def against_baseline(report: Report) -> str:
    """Each variant against the ``baseline`` variant of its model and seed (``report: baseline``): float
    perplexity relative to the baseline's, paired over the held-out documents both read; gate parameters
    as a share of the baseline's; first-token attention; the bit sweeps' perplexity changes."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    baseline = report.settings.baseline
    if not baseline:
        return ""
    base = {(c.model, c.seed): c for c in cells if c.variant == baseline}
    if not base:  # e.g. a smoke run, which keeps each model's first variant
        return ""
    swept = [(b, s) for points in bit_sweeps(schemes).values() for b, s in points]
    head = [
        "model",
        "variant",
        "seed",
        f"FP ppl vs {baseline}",
        f"gate params (x {baseline}'s)",
        "first-token attention (max layer)",
        *(f"{s}" for _, s in swept),
    ]
    lines = [
        "",
        f"## Against {baseline}",
        "",
        f"Float perplexity of each variant relative to `{baseline}` of the same model and seed, with its 95% "
        "paired interval over the held-out documents both read; gate parameters, and their multiple "
        f"of `{baseline}`'s where it has any; the quantized changes are each model's own (float to quantized). "
        + NOISE_LEGEND
        + ".",
        "",
        *table_head(head),
    ]
    for c in cells:
        b = base.get((c.model, c.seed))
        if b is None:
            continue
        params = c.cost.gate_params if c.cost else None, b.cost.gate_params if b.cost else None
        sink, layer = max_layer_sink(c)
        lines.append(
            "| "
            + " | ".join(
                [
                    c.model,
                    c.variant,
                    str(c.seed),
                    "-" if c is b else format_delta(float_change(b, c)),
                    "-"
                    if params[0] is None
                    else f"{params[0]:,}" + (f" ({params[0] / params[1]:.2f}x)" if params[1] else ""),
                    f"{sink:.2f} ({layer})",
                    *(format_delta(changes.get((c.id, s))) for _, s in swept),
                ]
            )
            + " |"
        )
    gaps = [(b, c) for c in cells if (b := base.get((c.model, c.seed))) is not None and c is not b]
    if gaps and schemes:
        lines += _paired_gaps(gaps, schemes, changes, baseline)
    return "\n".join(lines)


def _paired_gaps(
    gaps: list[tuple[CellRecord, CellRecord]], schemes: list[str], changes: Changes, baseline: str
) -> list[str]:
    """Each (baseline, variant) pair's quantized change of the variant minus the baseline's, per scheme, paired."""
    lines = [
        "",
        f"Paired against `{baseline}`: each scheme's change of the variant minus that of `{baseline}`, "
        "both read on the same documents, with its paired 95% interval over them (the decision: "
        f"negative and clear of 0, the variant loses less). {RATIO_NOTE}",
        "",
        *table_head(
            [
                "model",
                "variant",
                "seed",
                "scheme",
                f"{baseline} change",
                "variant change",
                "paired difference",
                "reading",
            ]
        ),
    ]
    for b, c in gaps:
        for s in schemes:
            gap = change_gap(b, c, s)
            own = [format_delta(changes.get((x.id, s))) for x in (b, c)]
            lines.append(
                f"| {c.model} | {c.variant} | {c.seed} | {s} | {own[0]} | {own[1]} | {format_delta(gap)} | "
                f"{gap_reading(gap, 'the variant')} |"
            )
    return lines


def side_by_side(report: Report) -> str:
    """The variants that several models share, one row each, the models' numbers in adjacent columns."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    models = list(dict.fromkeys(c.model for c in cells))
    by = {(c.model, c.variant): c for c in cells if c.seed == cells[0].seed}
    shared = [v for v in dict.fromkeys(c.variant for c in cells) if sum((m, v) in by for m in models) > 1]
    if len(models) < 2 or not shared:
        return ""
    scheme = schemes[0] if schemes else None

    def peak(c):
        top, ratio = peak_activation(c)
        return f"{fmt(top)} ({fmt(ratio)})"

    metrics = [
        ("FP ppl", lambda c: fmt(ppl_of(c.float_results))),
        ("first-token attn", lambda c: fmt(c.summary.sink_mass)),
        ("max activation (max / median)", peak),
        *([(f"{scheme} change", lambda c: format_delta(changes[c.id, scheme]))] if scheme else []),
        ("gate params", lambda c: _cost(c)[0]),
    ]
    head = ["variant"] + [f"{m}: {name}" for name, _ in metrics for m in models]
    lines = [
        "",
        f"## Models side by side ({' vs '.join(models)})",
        "",
        *table_head(head),
    ]
    for v in shared:
        row = [v] + [fn(by[(m, v)]) if (m, v) in by else "-" for _, fn in metrics for m in models]
        lines.append(table_row(row))
    return "\n".join(lines)


def quantization_error(report: Report) -> str:
    """Where quantization hurts: per cell and scheme, the logits' SQNR, the worst blocks and FP8 saturation."""
    lines = [
        "",
        "## Where quantization hurts",
        "",
        "| model | variant | scheme | logits SQNR (dB) | worst blocks (dB) | FP8 saturated values |",
        "|---|---|---|---|---|---|",
    ]
    for c in report.cells:
        for sch, r in c.schemes.items():
            if r.error is not None:
                lines.append(f"| {c.model} | {c.variant} | {sch} | not run: {r.error} | | |")
                continue
            worst = ", ".join(f"{w.layer} ({w.sqnr_db:.1f})" for w in r.worst_layers)
            lines.append(f"| {c.model} | {c.variant} | {sch} | {fmt(r.logits_sqnr_db)} | {worst} | {r.overflow} |")
    return "\n".join(lines)


def training(report: Report) -> str:
    """The cells trained in the study: steps, tokens, and their final train and held-out losses."""
    trained = [c for c in report.cells if c.is_trained]
    if not trained:
        return ""
    lines = [
        "",
        "## Training",
        "",
        "| model | variant | seed | steps | tokens | final train loss | held-out loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in trained:
        tr = c.trained
        lines.append(
            f"| {c.model} | {c.variant} | {c.seed} | {tr.steps} | {tr.tokens:,} | "
            f"{fmt(tr.final_train_loss)} | {fmt(tr.final_eval_loss)} |"
        )
    return "\n".join(lines)


def plots(report: Report) -> str:
    """The report's plots (:func:`plot_files`), each shown inline."""
    return "\n".join(["", "## Plots", ""] + [f"![{p}]({p})" for p in plot_files(report)])


def reading(report: Report) -> str:
    """The study file's own reading of the results (``report: notes``)."""
    notes = report.settings.notes.strip()
    if not notes:
        return ""
    return "\n".join(["", "## Reading (from the study file)", "", notes])


SECTIONS: Registry[str, Callable[[Report], str]] = Registry(
    "report section",
    {
        section.__name__: section
        for section in (
            header,
            criterion,
            fixes,
            answer,
            numbers,
            outliers,
            across_seeds,
            bit_budget,
            accuracy,
            gates,
            correlations,
            against_baseline,
            side_by_side,
            quantization_error,
            training,
            plots,
            reading,
        )
    },
)


def plot_files(report: Report) -> dict[str, Callable[[Path], object]]:
    """The report's plots, by file name in the order the page shows them, each with the function that draws it
    into a path: whether a plot exists is decided here alone."""
    cells, schemes, changes = report.cells, report.schemes, report.changes
    sweeps, fixes = bit_sweeps(schemes), report.settings.fixes
    per_width = {
        base: [(b, {c.id: changes[c.id, sch] for c in cells}) for b, sch in points] for base, points in sweeps.items()
    }
    per_model = {c.model: {s: changes[c.id, s] for s in schemes} for c in cells}
    trained = any(c.trained.observe_curve for c in cells)
    files: dict[str, Callable[[Path], object] | None] = {  # None: a plot this report does not have
        "study_layers.png": lambda path: plot_study_layers(cells, path),
        "study_quant.png": lambda path: plot_study_quant(cells, schemes, path),
        "study_bits.png": (lambda path: plot_bit_sweeps(per_width, [c.id for c in cells], BUDGET, path))
        if sweeps
        else None,
        "study_training.png": (lambda path: plot_study_training(cells, path)) if trained else None,
        "study_fixes.png": (lambda path: plot_fixes(per_model, fixes.within, path)) if fixes else None,
    }
    return {name: draw for name, draw in files.items() if draw is not None}


def study_markdown(metrics: StudyRecord) -> str:
    """report.md of a study run (:data:`SECTIONS`, in order)."""
    return Report.of(metrics).markdown()


def study_plots(metrics: StudyRecord, out: Path) -> None:
    """The plots of a study run's report (:func:`plot_files`), drawn into ``out``."""
    Report.of(metrics).draw(out)


def write_study_report(run_dir: str | Path, cluster: str | None = None, migrate: bool = False) -> Path:
    """report.md and plots of a study run directory, from its metrics.json alone, which is left as it is but for
    ``cluster`` ("work" or "document": the unit its intervals resample from now on, recorded in metrics.json) and
    ``migrate`` (write into a metrics.json of an older run what it lacks: :func:`~.compat.migrate`; a report reads
    it the same either way)."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)  # refuses a metrics.json that is not a study's, naming the problem
    changed = cluster is not None and edit_metrics(run_dir, lambda data: record_cluster(data, cluster))
    if migrate and edit_metrics(run_dir, compat.migrate):
        changed = True
    if changed:
        metrics = read_metrics(run_dir)
    report = Report.of(metrics)
    write_text_atomic(run_dir / "report.md", report.markdown())
    report.draw(run_dir)
    return run_dir / "report.md"
