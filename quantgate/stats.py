"""Intervals on the change quantization causes: per-document values in, a delta with its 95% interval out.

An evaluation keeps, per task, the values of each document (``qg.evaluate(...).documents[task]``), a
:class:`TaskDocuments` record: columns of equal length, ``ids`` first, e.g. ids ``[0, 1]``, loglikelihood
``[-812.5, -95.1]``, words ``[129, 17]``, bytes ``[783, 96]``, tokens ``[188, 25]``, works ``["Othello", "Jude"]``,
hashes ``["5f1c...", "9a0e..."]``: ``works`` the source group of each document (documents of one work are not
independent), ``hashes`` a hash of its text. :data:`METRICS` says how each reported metric is computed from them,
as lm-eval aggregates it (a ratio of sums over documents), so that

* :func:`paired_delta` compares a float and a quantized evaluation of the same documents: the relative
  change of a perplexity (``ppl_q / ppl_f - 1``) or the difference of an accuracy or bits per byte,
  with a 95% interval that resamples works (each document its own where no work is recorded): the wider
  of a cluster jackknife t-interval and a studentized cluster bootstrap (:func:`_interval`), whose coverage
  benchmarks/interval_coverage.py measures; below :data:`MIN_CLUSTERS` clusters it is marked approximate;
* :func:`paired_difference` compares two models' changes on the same documents (a gated and an ungated
  twin under one scheme): the difference of the changes, with the same interval;
* :func:`seed_delta` summarises the deltas of several training seeds: their mean (geometric for a perplexity
  ratio) and a t-interval;
* :func:`format_delta` prints one as ``+12.3% [+9.8, +14.9]``, with ``~`` where the interval holds 0;
  :func:`bound` turns an interval into the largest change it leaves possible ("no difference larger than").

:func:`spearman` and :func:`pearson` correlate two quantities across study cells (a report's correlation table,
the experiments' headlines).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from quantgate.errors import InputError
from quantgate.json_record import JsonRecord, json_field

__all__ = [
    "METRICS",
    "TaskDocuments",
    "Documents",
    "Columns",
    "Delta",
    "share_removed",
    "aggregate",
    "paired_delta",
    "paired_difference",
    "interval_method",
    "cluster_labels",
    "MIN_CLUSTERS",
    "CLUSTERS",
    "check_cluster",
    "bound",
    "seed_delta",
    "change",
    "format_delta",
    "format_ratio",
    "NOISE_LEGEND",
    "DELTA_LEGEND",
    "fmt",
    "table_head",
    "table_row",
    "pearson",
    "spearman",
]

CONFIDENCE = 0.95
RESAMPLES = 1000
# clusters below which the interval's measured coverage fell under 0.94 (results/bench/interval_coverage.md)
MIN_CLUSTERS = 9
CLUSTERS = ("work", "document")  # the units an interval may resample (a study's report: cluster)
RATIO_SCALE = 10  # a perplexity that grew this many times or more is printed, and differenced, as a ratio
NOISE_LEGEND = (
    "~ marks a change whose 95% interval includes 0 (within noise); [n/a]: no interval (no per-document "
    f"values recorded, or a single document); approximate: fewer than {MIN_CLUSTERS} independent works or "
    "documents, where the interval's coverage was measured below 0.94, and no verdict is drawn from it"
)
DELTA_LEGEND = (
    "Change (delta): quantized / float - 1 for perplexities, quantized - float for accuracies "
    "(percentage points) and bits per byte, with its 95% interval over the evaluated documents, resampled by "
    "work where they record one (documents of one work are not independent): each end the wider of a cluster "
    "jackknife t-interval (Bell-McCaffrey degrees of freedom) and a studentized cluster bootstrap (1,000 "
    "resamples), on the log ratio for a perplexity; its coverage is measured in results/bench/"
    "interval_coverage.md. " + NOISE_LEGEND + "."
)


@dataclass(frozen=True)
class Metric:
    """A metric as a ratio of sums over documents: sum(value) / sum(weight) (weight None, or an optional
    weight the documents lack: one per document), then exp(-x) for a perplexity, -x / ln 2 for bits per
    byte, x for an accuracy."""

    value: str
    weight: str | None
    kind: str  # "perplexity" (its change is relative), "bits" or "accuracy" (a difference)
    optional_weight: bool = False


METRICS = {
    "word_perplexity": Metric("loglikelihood", "words", "perplexity"),
    "byte_perplexity": Metric("loglikelihood", "bytes", "perplexity"),
    "bits_per_byte": Metric("loglikelihood", "bytes", "bits"),
    # tokens: computed tasks (masked, backcopy); lm-eval's loglikelihood tasks (cloze) record none, and
    # their perplexity is per document, exp(-mean loglikelihood)
    "perplexity": Metric("loglikelihood", "tokens", "perplexity", optional_weight=True),
    # backcopy without its first prediction (the uniformly random token after BOS)
    "perplexity_after_first": Metric("loglikelihood_after_first", "tokens_after_first", "perplexity"),
    "acc": Metric("acc", None, "accuracy"),
    "acc_norm": Metric("acc_norm", None, "accuracy"),
    "copy_acc": Metric("copied", "copies", "accuracy"),
}


@dataclass(frozen=True, kw_only=True)
class TaskDocuments(JsonRecord):
    """One task's per-document values: columns of one value per document, in the order of ``ids`` (lm-eval's
    ``doc_id``, a computed task's sequence number, an audit passage's id). A column the task does not record is None
    and absent from the JSON (which lists the columns in the fields' order). Which tasks record which:

    * ``loglikelihood`` (summed over the document, nats): the perplexity tasks, cloze, the computed tasks;
    * ``words``, ``bytes``: the rolling text tasks (lm-eval's word and byte perplexity weights);
    * ``tokens``: the tokens scored (rolling text tasks, counted with the model's tokenizer; masked tokens of the
      masked-LM task; predicted tokens of backcopy);
    * ``loglikelihood_after_first``, ``tokens_after_first``, ``copied``, ``copies``: backcopy without its first
      prediction, and its greedy hits on and count of the copied tokens;
    * ``acc``, ``acc_norm`` (1 or 0 per item): the multiple-choice and cloze tasks;
    * ``works``: each document's work, where the task's documents record one (the bundled text): the cluster an
      interval resamples;
    * ``hashes``: a hash of each document's text (or its tokens): which document a row is, not only where."""

    ids: list[int | str]
    loglikelihood: list[float] | None = json_field(omit_none=True)
    words: list[int] | None = json_field(omit_none=True)
    bytes: list[int] | None = json_field(omit_none=True)
    acc: list[float] | None = json_field(omit_none=True)
    acc_norm: list[float] | None = json_field(omit_none=True)
    works: list[str] | None = json_field(omit_none=True)
    hashes: list[str] | None = json_field(omit_none=True)
    tokens: list[int] | None = json_field(omit_none=True)
    loglikelihood_after_first: list[float] | None = json_field(omit_none=True)
    tokens_after_first: list[int] | None = json_field(omit_none=True)
    copied: list[int] | None = json_field(omit_none=True)
    copies: list[int] | None = json_field(omit_none=True)

    @classmethod
    def read(cls, docs: Columns) -> TaskDocuments:
        """``docs`` as a record: itself, or the record its JSON object holds (as eval.json keeps a task's)."""
        return docs if isinstance(docs, TaskDocuments) else cls.from_json(docs)

    def column(self, name: str) -> list | None:
        """The column a metric names (:class:`Metric`'s ``value`` or ``weight``); None where the task records none."""
        if name not in _COLUMNS:
            raise InputError(f"no per-document column {name!r}; known: {', '.join(_COLUMNS)}")
        return getattr(self, name)

    def first(self, n: int) -> TaskDocuments:
        """The values of the first ``n`` documents."""
        return TaskDocuments.from_json({name: column[:n] for name, column in self.to_json().items()})

    def recorded(self) -> list[str]:
        """The names of the columns recorded, ``ids`` aside, in order."""
        return [name for name in _COLUMNS[1:] if self.column(name) is not None]


_COLUMNS = tuple(f.name for f in fields(TaskDocuments))
Columns = TaskDocuments | Mapping[str, Any]  # a task's per-document values, as a record or as its JSON object
Documents = dict[str, TaskDocuments]  # {task: its per-document values}


@dataclass(frozen=True)
class Delta:
    """A change and its interval (low/high None where there is none); ``method`` says how it was found."""

    value: float
    low: float | None
    high: float | None
    # as Metric.kind; "points" (a difference of two changes, in points); "ratio" (a ratio of two perplexity ratios,
    # minus 1); "difference" (other)
    kind: str
    n: int  # documents, or seeds
    method: str
    clusters: int | None = None  # the independent units the interval resampled (works, or documents)
    approximate: bool = False  # too few clusters for the interval's measured coverage: no verdict from it

    @property
    def within_noise(self) -> bool | None:
        return None if self.low is None or self.high is None else self.low <= 0 <= self.high

    @property
    def decisive(self) -> bool:
        """An interval a verdict may be drawn from: there is one, and it is not approximate."""
        return self.low is not None and self.high is not None and not self.approximate

    def __str__(self) -> str:
        return format_delta(self)


def _metric(name: str) -> Metric:
    if name not in METRICS:
        raise InputError(f"no per-document aggregate for metric {name!r}; known: {', '.join(METRICS)}")
    return METRICS[name]


def _columns(docs: TaskDocuments, metric: Metric) -> tuple[np.ndarray, np.ndarray]:
    value = docs.column(metric.value)
    weight = docs.column(metric.weight) if metric.weight is not None else None
    needed = (metric.value,) if metric.optional_weight or metric.weight is None else (metric.value, metric.weight)
    missing = [c for c in needed if docs.column(c) is None]
    if missing:
        raise InputError(
            f"the per-document values hold no {', '.join(missing)} column (they have {', '.join(docs.recorded())})"
        )
    v = np.asarray(value, dtype=np.float64)
    return v, np.asarray(weight, dtype=np.float64) if weight is not None else np.ones_like(v)


def _transform(kind: str, x):
    return np.exp(-x) if kind == "perplexity" else -x / math.log(2) if kind == "bits" else x


def aggregate(docs: Columns, metric: str) -> float:
    """``metric`` over the documents, as lm-eval aggregates it (e.g. word_perplexity =
    exp(-sum loglikelihood / sum words))."""
    m = _metric(metric)
    value, weight = _columns(TaskDocuments.read(docs), m)
    return float(_transform(m.kind, value.sum() / weight.sum()))


def _log_ratio(vf, wf, vq, wq, *, axis=-1):
    """log(ppl_q / ppl_f) of a perplexity's columns (vectorised along ``axis`` for the bootstrap)."""
    return vf.sum(axis) / wf.sum(axis) - vq.sum(axis) / wq.sum(axis)


def _change(kind: str, vf, wf, vq, wq, *, axis=-1):
    """The change from float to quantized of the aggregate (vectorised along ``axis`` for the bootstrap)."""
    if kind == "perplexity":
        return np.expm1(_log_ratio(vf, wf, vq, wq, axis=axis))  # exp(-sq) / exp(-sf) - 1
    return _transform(kind, vq.sum(axis) / wq.sum(axis)) - _transform(kind, vf.sum(axis) / wf.sum(axis))


def paired_delta(
    float_docs: Columns,
    quant_docs: Columns,
    metric: str,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
    cluster: str = "work",
) -> Delta:
    """The change of ``metric`` from the float to the quantized evaluation of the same documents
    (relative for a perplexity, a difference otherwise) with a paired interval that resamples ``cluster``:
    ``work`` (the documents' works, where they record them; else each document) or ``document``."""
    float_docs, quant_docs = TaskDocuments.read(float_docs), TaskDocuments.read(quant_docs)
    _same_documents(float_docs, quant_docs, "the float and quantized evaluations")
    m = _metric(metric)
    data = (*_columns(float_docs, m), *_columns(quant_docs, m))

    def statistic(*columns, axis=-1):
        return _change(m.kind, *columns, axis=axis)

    clusters = cluster_labels(float_docs, cluster)
    return _interval(data, statistic, m.kind, m.kind == "perplexity", resamples, seed, confidence, clusters)


def paired_difference(
    base: tuple[Columns, Columns],
    other: tuple[Columns, Columns],
    metric: str,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
    cluster: str = "work",
) -> Delta:
    """How much more ``other`` changes than ``base``: (its change of ``metric``) - (``base``'s), each pair
    (float documents, quantized documents) evaluated on the same documents as the other pair, with a paired
    interval over those documents (:func:`interval_method`). For a perplexity the changes are relative, so
    the difference is in percentage points (``kind`` "points"); for an accuracy in points as well. Where
    either perplexity grew :data:`RATIO_SCALE`-fold or more, a difference of points means little (5.03e+07x
    against 1.04e+06x is "-4.9e9 pp"): the difference is then the ratio of the two perplexity ratios, minus 1
    (``kind`` "ratio", printed ``0.021x [...]``; its jackknife interval on the log). Negative: ``other`` (say
    the gated twin) loses less."""
    reference, *others = (TaskDocuments.read(docs) for docs in (*base, *other))
    for docs in others:
        _same_documents(reference, docs, "the four evaluations of a paired difference")
    m = _metric(metric)
    data = tuple(col for docs in (reference, *others) for col in _columns(docs, m))
    clusters = cluster_labels(reference, cluster)
    if m.kind == "perplexity" and max(_log_ratio(*data[:4]), _log_ratio(*data[4:])) >= math.log(RATIO_SCALE):

        def ratio(*c, axis=-1):
            return np.expm1(_log_ratio(*c[4:], axis=axis) - _log_ratio(*c[:4], axis=axis))

        return _interval(data, ratio, "ratio", True, resamples, seed, confidence, clusters)

    def statistic(*c, axis=-1):
        return _change(m.kind, *c[4:], axis=axis) - _change(m.kind, *c[:4], axis=axis)

    kind = "points" if m.kind in ("perplexity", "accuracy") else m.kind
    return _interval(data, statistic, kind, False, resamples, seed, confidence, clusters)


def interval_method(clusters: int) -> str:
    """The interval a change over ``clusters`` independent units (works, or documents where none is recorded)
    gets: none below 2, else the cluster interval (:func:`_interval`), ``approximate`` below
    :data:`MIN_CLUSTERS`, where its coverage was not measured at 0.94 or more."""
    return "none" if clusters < 2 else "approximate" if clusters < MIN_CLUSTERS else "cluster"


def cluster_labels(docs: Columns, cluster: str = "work") -> list | None:
    """The cluster of each document: its work (the ``works`` column) for ``cluster`` "work"; None (each document
    its own) for "document" or where the documents record no work."""
    check_cluster(cluster)
    works = TaskDocuments.read(docs).works
    return list(works) if cluster == "work" and works is not None else None


def check_cluster(cluster: str) -> None:
    """Refuse a cluster level other than :data:`CLUSTERS`, naming them."""
    if cluster not in CLUSTERS:
        raise InputError(f"unknown cluster {cluster!r}: one of {', '.join(CLUSTERS)}")


def _totals(data: tuple, clusters) -> tuple[tuple[np.ndarray, ...], int]:
    """Each column of ``data`` summed within each cluster (G,), and G; every document its own cluster where
    ``clusters`` is None."""
    if clusters is None:
        return tuple(np.asarray(c, dtype=np.float64) for c in data), len(data[0])
    _, inv = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)
    g = int(inv.max()) + 1
    return tuple(np.bincount(inv, np.asarray(c, dtype=np.float64), g) for c in data), g


def _bm_df(share: np.ndarray) -> float:
    """Bell and McCaffrey's degrees of freedom of a cluster-robust variance of a weighted mean whose clusters
    hold ``share`` of the weight (a Satterthwaite approximation under independent documents whose variance
    falls as one over their weight; Imbens and Kolesar 2016): 1 / tr(K^2), K = diag(a) - v v', a = h / (1 - h),
    v^2 = h^2 / (1 - h). G - 1 for G equal clusters; fewer where a few clusters hold most of the weight."""
    a = share / (1 - share)
    v2 = share**2 / (1 - share)
    return float(1 / ((a**2).sum() - 2 * (a * v2).sum() + v2.sum() ** 2))


def _loo(statistic, totals: tuple[np.ndarray, ...]) -> np.ndarray:
    """The statistic without each cluster in turn: totals (..., G) in, (..., G) out."""
    return np.asarray(statistic(*((t.sum(-1, keepdims=True) - t)[..., None] for t in totals)))


def _interval(
    data: tuple,
    statistic,
    kind: str,
    log_ratio: bool,
    resamples: int,
    seed: int,
    confidence: float,
    clusters=None,
) -> Delta:
    """``statistic`` (a function of the columns' sums) of the document columns ``data`` with its interval
    over clusters (``clusters``: a label per document; None: every document its own), on the log of 1 + x
    where ``log_ratio``. The interval holds two intervals, each end the wider of the two:

    * the cluster jackknife t-interval: the standard error from the statistic without each cluster in turn, the
      root of the summed squared deviations from the whole's value (for a weighted mean, the leverage-corrected
      cluster-robust variance CR3, without a (G - 1) / G factor), its t quantile at Bell and
      McCaffrey's degrees of freedom (:func:`_bm_df`, from each cluster's share of the weight ``data[1]``), which
      fall below G - 1 where few clusters hold most of the words;
    * from :data:`MIN_CLUSTERS` clusters on, the studentized cluster bootstrap (bootstrap-t): clusters resampled
      with replacement ``resamples`` times, each resample studentized by its own jackknife standard error, which
      follows a skewed damage (a few documents hurt far more) that a t quantile misses.

    Its coverage is measured, not assumed (benchmarks/interval_coverage.py, results/bench/interval_coverage.md):
    below :data:`MIN_CLUSTERS` clusters it fell under 0.94 and the interval is marked approximate."""
    value = float(statistic(*data))
    n = len(data[0])
    totals, g = _totals(data, clusters)
    units = f"{n} documents in {g} work{'s' * (g != 1)}" if clusters is not None else f"{n} documents"
    method = interval_method(g)
    if method == "none":
        return Delta(value, None, None, kind, n, f"no interval: {units}", clusters=g)
    link, back = (np.log1p, np.expm1) if log_ratio else (lambda x: np.asarray(x, dtype=np.float64), lambda x: x)
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = float(link(value))
        se = math.sqrt(float(((link(_loo(statistic, totals)) - centre) ** 2).sum()))
        df = _bm_df(totals[1] / totals[1].sum())
    import scipy.stats  # scipy.stats: imported at first use (it takes ~1.5 s to import)

    alpha = (1 - confidence) / 2
    half = float(scipy.stats.t.ppf(1 - alpha, df)) * se
    low, high = centre - half, centre + half
    how = f"cluster jackknife t ({df:.1f} df)"
    if g >= MIN_CLUSTERS and resamples > 0 and se > 0:  # below, bootstrap-t's ends run off to +-100%
        how += f" and studentized cluster bootstrap ({resamples:,} resamples, seed {seed})"
        idx = np.random.default_rng(seed).integers(0, g, (resamples, g))
        drawn = tuple(t[idx] for t in totals)
        with np.errstate(divide="ignore", invalid="ignore"):
            theta = link(np.asarray(statistic(*drawn)))
            se_b = np.sqrt(((link(_loo(statistic, drawn)) - theta[:, None]) ** 2).sum(-1))
            t = (theta - centre) / se_b
        t = t[np.isfinite(t)]  # a resample of one cluster drawn G times has no spread to studentize by
        if len(t):
            low = min(low, centre - float(np.quantile(t, 1 - alpha, method="higher")) * se)
            high = max(high, centre - float(np.quantile(t, alpha, method="lower")) * se)
    how += f" over {units}" + (", on the log ratio" if log_ratio else "")
    approximate = method == "approximate"
    if approximate:
        how += f"; approximate: fewer than {MIN_CLUSTERS} clusters"
    return Delta(value, float(back(low)), float(back(high)), kind, n, how, clusters=g, approximate=approximate)


def _same_documents(reference: TaskDocuments, docs: TaskDocuments, what: str) -> None:
    if list(reference.ids) != list(docs.ids):
        raise InputError(
            f"{what} cover different documents ({len(reference.ids)} vs {len(docs.ids)} ids, first "
            f"difference at {_first_difference(reference.ids, docs.ids)}): evaluate them on the same "
            f"tasks with the same limit"
        )


def _first_difference(a, b) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"position {i}"


def seed_delta(deltas: list[float], kind: str, confidence: float = CONFIDENCE) -> Delta:
    """One delta per training seed summarised with a Student t-interval across the seeds: for a perplexity,
    the geometric mean of the ratios ``1 + delta`` with the interval taken on their logarithms (a ratio's
    spread is multiplicative: 2x and 500x average to 32x, and the interval stays above 0x); otherwise the
    arithmetic mean."""
    x = np.asarray(deltas, dtype=np.float64)
    ratio = kind == "perplexity"
    if ratio:
        x = np.log1p(x)
    k, mean = len(x), float(x.mean())
    back = np.expm1 if ratio else float
    how = "geometric mean of the perplexity ratios" if ratio else "mean"
    if k < 2:
        return Delta(float(back(mean)), None, None, kind, k, f"no interval: {k} seed")
    import scipy.stats  # scipy.stats: imported at first use (it takes ~1.5 s to import)

    half = float(scipy.stats.t.ppf((1 + confidence) / 2, k - 1) * x.std(ddof=1) / math.sqrt(k))
    return Delta(
        float(back(mean)),
        float(back(mean - half)),
        float(back(mean + half)),
        kind,
        k,
        f"{how} over {k} seeds, t-interval across seeds" + (" on log ratios" if ratio else ""),
    )


def change(
    metric: str,
    float_value: float | None,
    quant_value: float | None,
    float_docs: Columns | None = None,
    quant_docs: Columns | None = None,
    cluster: str = "work",
) -> Delta | None:
    """The change of ``metric``: with its paired interval where both evaluations kept per-document
    values, else the point change from the two aggregates, without an interval; None without both values."""
    if float_value is None or quant_value is None:
        return None
    if float_docs and quant_docs and metric in METRICS:
        return paired_delta(float_docs, quant_docs, metric, cluster=cluster)
    kind = METRICS[metric].kind if metric in METRICS else "perplexity" if "perplexity" in metric else "difference"
    value = quant_value / float_value - 1 if kind == "perplexity" else quant_value - float_value
    return Delta(value, None, None, kind, 0, "no interval: no per-document values recorded")


def format_delta(d: Delta | None, noise: str = " ~") -> str:
    """``+12.3% [+9.8, +14.9]`` (relative), ``-1.5 pp [-3.0, +0.0] ~`` (accuracy, in percentage points),
    ``+0.0123 [+0.0101, +0.0147]`` (other differences); a perplexity that grew 10x or more, or whose
    interval reaches 10x, as the ratio (:func:`format_ratio`); ``[n/a]`` without an interval; ``noise`` marks
    a change whose interval includes 0."""
    if d is None:
        return "-"
    if d.kind == "ratio" or (d.kind == "perplexity" and max(d.value, d.high or 0) >= RATIO_SCALE - 1):
        return format_ratio(d, noise)
    scale = 100 if d.kind in ("perplexity", "accuracy", "points") else 1
    values = [v * scale for v in (d.value, d.low, d.high) if v is not None]
    if d.kind not in ("perplexity", "accuracy", "points"):
        fmt = "{:+.3g}".format
    else:
        decimals = 2 if max(abs(v) for v in values) < 1 else 1
        fmt = f"{{:+.{decimals}f}}".format
    unit = {"perplexity": "%", "accuracy": " pp", "points": " pp"}.get(d.kind, "")
    interval = "[n/a]" if d.low is None or d.high is None else f"[{fmt(d.low * scale)}, {fmt(d.high * scale)}]"
    return f"{fmt(d.value * scale)}{unit} {interval}" + (noise if d.within_noise else "") + _approximate(d)


def _approximate(d: Delta) -> str:
    return " approximate" if d.approximate else ""


def share_removed(base: float, other: float) -> float | None:
    """The share of ``base``'s change (a fraction, e.g. an ungated model's perplexity change) that ``other``'s does
    not have: 1 - other / base (negative: ``other`` adds to it); None where ``base``'s change is not above 0."""
    return 1 - other / base if base > 0 else None


def bound(d: Delta | None) -> float | None:
    """The largest change, either way, that ``d``'s interval leaves possible: max(|low|, |high|), what "no
    difference larger than" rests on; None without a decisive interval (:attr:`Delta.decisive`)."""
    if d is None or not d.decisive:
        return None
    assert d.low is not None and d.high is not None
    return max(abs(d.low), abs(d.high))


def table_head(columns: list[str]) -> list[str]:
    """A markdown table's header: the column names and the rule under them."""
    return [table_row(columns), "|" + "---|" * len(columns)]


def table_row(cells: Iterable[str]) -> str:
    """A markdown table's row of ``cells`` (text, as printed)."""
    return "| " + " | ".join(cells) + " |"


def fmt(v: object) -> str:
    """A table cell: ``-`` for None, four significant digits for a float (``nan`` for NaN), else ``str``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_ratio(d: Delta | None, noise: str = " ~") -> str:
    """A perplexity change as the ratio ppl_new / ppl_base (1 + ``d``) with its interval, ``2.26x [1.90, 2.70]``;
    ``[n/a]`` without an interval; ``noise`` marks one that includes 1."""
    if d is None:
        return "-"
    r = [1 + v for v in (d.value, d.low, d.high) if v is not None]
    decimals = 0 if max(r) >= 100 else 1 if max(r) >= 10 else 2 if len(r) == 1 or max(r) - min(r) >= 0.05 else 3
    wide = "{:.3g}".format if max(r) >= 1e6 else f"{{:,.{decimals}f}}".format

    def fmt(v: float) -> str:  # a ratio below 1 keeps two significant digits beside a wide one: 0.019, not 0
        return f"{v:.2g}" if v < 1 and decimals < 2 else wide(v)

    interval = "[n/a]" if d.low is None or d.high is None else f"[{fmt(1 + d.low)}, {fmt(1 + d.high)}]"
    return f"{fmt(1 + d.value)}x {interval}" + (noise if d.within_noise else "") + _approximate(d)


def _ranks(values: list[float]) -> list[float]:
    """The rank of each value, 1 for the smallest; tied values share their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson's correlation of ``x`` and ``y``; None below 3 pairs or where either is constant."""
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sx = sum((a - mx) ** 2 for a in x) ** 0.5
    sy = sum((b - my) ** 2 for b in y) ** 0.5
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / (sx * sy)


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation: :func:`pearson` of the ranks (ties take their average rank)."""
    return pearson(_ranks(x), _ranks(y))
