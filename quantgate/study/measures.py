"""What a study cell's numbers say: its headline perplexity, the change a scheme causes (with its paired
interval, :mod:`quantgate.stats`), its largest activation and sink, and the activation-bit budget of a
bit sweep. The report, the "Which fix?" section, the experiments and the headline script read these."""

from __future__ import annotations

from ..eval.tasks import TASKS, accuracy_keys, perplexity_keys
from ..quant.schemes import act_bits
from ..stats import METRICS, Delta, bound, change, cluster_labels, paired_difference
from .records import CellRecord, Results

__all__ = [
    "ppl_keys",
    "accuracy_metrics",
    "after_first",
    "BUDGET",
    "metric_of",
    "ppl_of",
    "ppl_key",
    "ppl_change",
    "scheme_change",
    "float_change",
    "change_gap",
    "gap_reading",
    "format_bound",
    "read_on",
    "peak_activation",
    "max_layer_sink",
    "bit_sweeps",
    "budget",
]

TaskMetric = tuple[str, str]  # (task, metric)


def ppl_keys() -> tuple[TaskMetric, ...]:
    """The headline perplexity of a cell: the first of these its tasks report (each task's row, in table order)."""
    return perplexity_keys()


def accuracy_metrics() -> tuple[TaskMetric, ...]:
    """The (task, metric) of each task's headline accuracy."""
    return accuracy_keys()


def after_first() -> TaskMetric:
    """The perplexity without a sequence's first prediction, of the task that reports one (backcopy's: the uniformly
    random token after BOS, whose prediction the last block's BOS outlier serves)."""
    return next((n, t.perplexity_without_first) for n, t in TASKS.items() if t.perplexity_without_first)


BUDGET = 0.01  # the perplexity increase a bit budget allows


def metric_of(results: Results | None, task_metric: TaskMetric) -> float | None:
    """``results[task][metric]``, or None where the evaluation lacks it."""
    task, metric = task_metric
    return ((results or {}).get(task) or {}).get(metric)


def ppl_of(results: Results | None) -> float | None:
    """The headline perplexity in an evaluation's results (see :func:`ppl_keys`), or None."""
    return next((v for v in (metric_of(results, k) for k in ppl_keys()) if v is not None), None)


def ppl_key(cell: CellRecord) -> TaskMetric | None:
    """The (task, metric) of a study cell's headline perplexity (see :func:`ppl_keys`), or None."""
    return next((k for k in ppl_keys() if metric_of(cell.float_results, k) is not None), None)


def ppl_change(cell: CellRecord, scheme: str) -> Delta | None:
    """The change of the headline perplexity that ``scheme`` causes in a study cell, a
    :class:`~quantgate.stats.Delta` (interval n/a where the cell kept no per-document values), or None."""
    key = ppl_key(cell)
    return scheme_change(cell, scheme, key) if key else None


def scheme_change(cell: CellRecord, scheme: str, task_metric: TaskMetric) -> Delta | None:
    """The change of ``task_metric`` (task, metric) that ``scheme`` causes in a study cell (as :func:`ppl_change`)."""
    r = cell.scheme(scheme)
    task, metric = task_metric
    return change(
        metric,
        metric_of(cell.float_results, task_metric),
        metric_of(r.results, task_metric),
        cell.float_documents.get(task),
        r.documents.get(task),
        cell.cluster,
    )


def float_change(base: CellRecord, cell: CellRecord) -> Delta | None:
    """``cell``'s headline float perplexity relative to ``base``'s (another model read on the same documents),
    with the paired interval over those documents; None where either lacks it."""
    key = ppl_key(base)
    if key is None:
        return None
    docs = [c.float_documents.get(key[0]) for c in (base, cell)]
    return change(
        key[1], metric_of(base.float_results, key), metric_of(cell.float_results, key), docs[0], docs[1], base.cluster
    )


def change_gap(base: CellRecord, cell: CellRecord, scheme: str, task_metric: TaskMetric | None = None) -> Delta | None:
    """How much more ``scheme`` changes ``cell``'s headline perplexity (or ``task_metric``) than ``base``'s (a
    gated twin against its ungated one, both read on the same documents): the paired difference of the two
    changes (:func:`quantgate.stats.paired_difference`); None where either lacks the scheme or per-document
    values, or they read different documents."""
    key = task_metric or ppl_key(base)
    if key is None or scheme not in base.schemes or scheme not in cell.schemes:
        return None
    docs = [d for c in (base, cell) for d in (c.float_documents.get(key[0]), c.scheme(scheme).documents.get(key[0]))]
    found = [d for d in docs if d is not None]
    if (
        len(found) < 4
        or len({tuple(d.ids) for d in found}) > 1
        or any(d.column(METRICS[key[1]].value) is None for d in found)
    ):
        return None
    return paired_difference((found[0], found[1]), (found[2], found[3]), key[1], cluster=base.cluster)


def gap_reading(gap: Delta | None, who: str = "the gated model") -> str:
    """A paired difference of changes in words, no stronger than its interval: who loses less or more, or the
    bound the interval puts on any difference ("no difference larger than 0.42 pp"); none from an approximate
    interval."""
    if gap is None or gap.low is None or gap.high is None:
        return "no paired interval (no per-document values on the same documents)"
    if gap.approximate:
        return "approximate interval (too few independent works or documents): no verdict"
    if gap.high < 0:
        return f"{who} loses less"
    if gap.low > 0:
        return f"{who} loses more"
    return f"within noise: no difference larger than {format_bound(gap)}"


def read_on(cell: CellRecord) -> str:
    """How many documents the cell's headline perplexity was read on and from how many works: ``24 (9 works)``
    (the intervals resample the works), ``12 (1 work; resampled by document)`` where the study's report declares
    ``cluster: document``; ``128`` where the documents record no work (each its own)."""
    key = ppl_key(cell)
    docs = cell.float_documents.get(key[0]) if key else None
    if docs is None:
        return "-"
    labels = cluster_labels(docs)
    if labels is None:
        return f"{len(docs.ids)}"
    works = len(set(map(str, labels)))
    by = "; resampled by document" if cell.cluster == "document" else ""
    return f"{len(docs.ids)} ({works} work{'s' * (works != 1)}{by})"


def format_bound(d: Delta) -> str:
    """:func:`quantgate.stats.bound` in ``d``'s unit: ``0.42 pp``, ``1.3%``, ``1.05x`` (a ratio's farther end)."""
    b = bound(d)
    if b is None:
        return "n/a"
    if d.kind == "ratio":
        assert d.low is not None and d.high is not None
        return f"{max(1 + d.high, 1 / (1 + d.low)):.3g}x either way"
    unit = {"perplexity": "%", "accuracy": " pp", "points": " pp"}.get(d.kind)
    return f"{100 * b:.2g}{unit}" if unit else f"{b:.3g}"


def peak_activation(cell: CellRecord) -> tuple[float | None, float | None]:
    """A cell's largest residual-stream activation and the max / median |x| of the block that holds it."""
    top = max(cell.layers, key=lambda L: L.max_activation, default=None)
    summary = cell.summary
    return summary.max_activation, top.max_median_ratio if top else summary.max_median_ratio


def max_layer_sink(cell: CellRecord) -> tuple[float, int]:
    """A cell's largest per-layer first-token attention, and its layer (of the layers with attention)."""
    return max((L.sink_mass, i) for i, L in enumerate(cell.layers) if L.sink_mass is not None)


def bit_sweeps(schemes: list[str]) -> dict[str, list[tuple[int, str]]]:
    """Schemes that differ only in their activation width: ``{base: [(bits, scheme), ...]}``, widest
    first, for every base with at least two widths."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for scheme in schemes:
        base, bits = act_bits(scheme)
        if bits is not None:
            groups.setdefault(base, []).append((bits, scheme))
    return {base: sorted(g, reverse=True) for base, g in groups.items() if len(g) > 1}


def budget(points: list[tuple[int, Delta | None]]) -> tuple[int, Delta] | None:
    """The fewest bits whose perplexity increase, and that of every wider width, stays under
    :data:`BUDGET`: ``(bits, its Delta)``; None when even the widest exceeds it. ``points`` widest first."""
    found = None
    for bits, d in points:
        if d is None or d.value >= BUDGET:
            break
        found = (bits, d)
    return found
