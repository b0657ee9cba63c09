"""Intervals on the change quantization causes: per-document values in, a delta with its 95% interval out.

An evaluation keeps, per task, the values of each document (``qg.evaluate(...)["documents"][task]``):
columns of equal length, ``ids`` first, e.g. ``{"ids": [0, 1], "loglikelihood": [-812.5, -95.1],
"words": [129, 17], "bytes": [783, 96], "tokens": [188, 25]}``. :data:`METRICS` says how each reported
metric is computed from them, as lm-eval aggregates it (a ratio of sums over documents), so that

* :func:`paired_delta` compares a float and a quantized evaluation of the same documents: the relative
  change of a perplexity (``ppl_q / ppl_f - 1``) or the difference of an accuracy or bits per byte,
  with a 95% interval over documents (:func:`interval_method`): from a paired bootstrap
  (``scipy.stats.bootstrap``, BCa; the aggregate recomputed on every resample) where there are at least
  :data:`MIN_BOOTSTRAP_UNITS` documents, else a jackknife t-interval (n - 1 degrees of freedom; for a
  perplexity on the log ratio), since BCa's intervals are too narrow at a handful of documents;
* :func:`paired_difference` compares two models' changes on the same documents (a gated and an ungated
  twin under one scheme): the difference of the changes, with the same rule for its interval;
* :func:`seed_delta` summarises the deltas of several training seeds: their mean (geometric for a perplexity
  ratio) and a t-interval;
* :func:`format_delta` prints one as ``+12.3% [+9.8, +14.9]``, with ``~`` where the interval holds 0.

:func:`spearman` and :func:`pearson` correlate two quantities across study cells (a report's correlation table,
the experiments' headlines).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

__all__ = [
    "METRICS",
    "Delta",
    "aggregate",
    "paired_delta",
    "paired_difference",
    "interval_method",
    "MIN_BOOTSTRAP_UNITS",
    "seed_delta",
    "change",
    "format_delta",
    "format_ratio",
    "NOISE_LEGEND",
    "DELTA_LEGEND",
    "fmt",
    "table_head",
    "pearson",
    "spearman",
]

CONFIDENCE = 0.95
RESAMPLES = 1000
MIN_BOOTSTRAP_UNITS = 20  # independent documents below which BCa under-covers: a jackknife t-interval instead
RATIO_SCALE = 10  # a perplexity that grew this many times or more is printed, and differenced, as a ratio
NOISE_LEGEND = (
    "~ marks a change whose 95% interval includes 0 (within noise); [n/a]: no interval (no per-document "
    "values recorded, or a single document)"
)
DELTA_LEGEND = (
    "Change (delta): quantized / float - 1 for perplexities, quantized - float for accuracies "
    "(percentage points) and bits per byte, with its 95% interval over the evaluated documents: a paired "
    f"bootstrap (1,000 resamples, BCa) from {MIN_BOOTSTRAP_UNITS} documents on, a jackknife t-interval (n - 1 "
    "degrees of freedom, on the log ratio for a perplexity) below. " + NOISE_LEGEND + "."
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

    @property
    def within_noise(self) -> bool | None:
        return None if self.low is None or self.high is None else self.low <= 0 <= self.high

    def __str__(self) -> str:
        return format_delta(self)


def _metric(name: str) -> Metric:
    if name not in METRICS:
        raise ValueError(f"no per-document aggregate for metric {name!r}; known: {', '.join(METRICS)}")
    return METRICS[name]


def _columns(docs: dict, metric: Metric) -> tuple[np.ndarray, np.ndarray]:
    needed = (metric.value,) if metric.optional_weight or metric.weight is None else (metric.value, metric.weight)
    missing = [c for c in needed if c not in docs]
    if missing:
        raise ValueError(
            f"the per-document values hold no {', '.join(missing)} column (they have "
            f"{', '.join(k for k in docs if k != 'ids')})"
        )
    value = np.asarray(docs[metric.value], dtype=np.float64)
    weight = np.asarray(docs[metric.weight], dtype=np.float64) if metric.weight in docs else np.ones_like(value)
    return value, weight


def _transform(kind: str, x):
    return np.exp(-x) if kind == "perplexity" else -x / math.log(2) if kind == "bits" else x


def aggregate(docs: dict, metric: str) -> float:
    """``metric`` over the documents, as lm-eval aggregates it (e.g. word_perplexity =
    exp(-sum loglikelihood / sum words))."""
    m = _metric(metric)
    value, weight = _columns(docs, m)
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
    float_docs: dict,
    quant_docs: dict,
    metric: str,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Delta:
    """The change of ``metric`` from the float to the quantized evaluation of the same documents
    (relative for a perplexity, a difference otherwise) with a paired interval over documents
    (:func:`interval_method`)."""
    _same_documents(float_docs, quant_docs, "the float and quantized evaluations")
    m = _metric(metric)
    data = (*_columns(float_docs, m), *_columns(quant_docs, m))

    def statistic(*columns, axis=-1):
        return _change(m.kind, *columns, axis=axis)

    return _interval(data, statistic, m.kind, m.kind == "perplexity", resamples, seed, confidence)


def paired_difference(
    base: tuple[dict, dict],
    other: tuple[dict, dict],
    metric: str,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Delta:
    """How much more ``other`` changes than ``base``: (its change of ``metric``) - (``base``'s), each pair
    (float documents, quantized documents) evaluated on the same documents as the other pair, with a paired
    interval over those documents (:func:`interval_method`). For a perplexity the changes are relative, so
    the difference is in percentage points (``kind`` "points"); for an accuracy in points as well. Where
    either perplexity grew :data:`RATIO_SCALE`-fold or more, a difference of points means little (5.03e+07x
    against 1.04e+06x is "-4.9e9 pp"): the difference is then the ratio of the two perplexity ratios, minus 1
    (``kind`` "ratio", printed ``0.021x [...]``; its jackknife interval on the log). Negative: ``other`` (say
    the gated twin) loses less."""
    for docs in (base[1], *other):
        _same_documents(base[0], docs, "the four evaluations of a paired difference")
    m = _metric(metric)
    data = tuple(col for docs in (*base, *other) for col in _columns(docs, m))
    if m.kind == "perplexity" and max(_log_ratio(*data[:4]), _log_ratio(*data[4:])) >= math.log(RATIO_SCALE):

        def ratio(*c, axis=-1):
            return np.expm1(_log_ratio(*c[4:], axis=axis) - _log_ratio(*c[:4], axis=axis))

        return _interval(data, ratio, "ratio", True, resamples, seed, confidence)

    def statistic(*c, axis=-1):
        return _change(m.kind, *c[4:], axis=axis) - _change(m.kind, *c[:4], axis=axis)

    kind = "points" if m.kind in ("perplexity", "accuracy") else m.kind
    return _interval(data, statistic, kind, False, resamples, seed, confidence)


def interval_method(n: int) -> str:
    """The interval a change over ``n`` independent documents gets: none below 2, a jackknife t-interval
    below :data:`MIN_BOOTSTRAP_UNITS`, a BCa paired bootstrap from there on."""
    return "none" if n < 2 else "jackknife-t" if n < MIN_BOOTSTRAP_UNITS else "BCa"


def _interval(
    data: tuple, statistic, kind: str, log_ratio: bool, resamples: int, seed: int, confidence: float
) -> Delta:
    """``statistic`` of the document columns ``data`` with its interval (:func:`interval_method`);
    ``log_ratio``: the statistic is a relative change, whose jackknife interval is taken on log(1 + x)."""
    value = float(statistic(*data))
    n = len(data[0])
    method = interval_method(n)
    if method == "none":
        return Delta(value, None, None, kind, n, f"no interval: {n} document")
    if method == "jackknife-t":
        low, high = _jackknife_t(data, statistic, value, log_ratio, confidence)
        on = ", on the log ratio" if log_ratio else ""
        return Delta(
            value,
            low,
            high,
            kind,
            n,
            f"jackknife t-interval over {n} documents ({n - 1} df{on}; fewer than {MIN_BOOTSTRAP_UNITS} for BCa)",
        )
    import scipy.stats  # scipy.stats: imported at first use (it takes ~1.5 s to import)

    common = {"paired": True, "vectorized": True, "confidence_level": confidence, "batch": min(resamples, 250)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # BCa on a distribution without spread: handled below
        res = scipy.stats.bootstrap(data, statistic, n_resamples=resamples, rng=seed, **common)
        how = "BCa"
        if not np.isfinite([res.confidence_interval.low, res.confidence_interval.high]).all():
            # BCa is undefined where every resample (or jackknife) gives the same value: percentile instead
            res = scipy.stats.bootstrap(
                data, statistic, n_resamples=0, bootstrap_result=res, method="percentile", **common
            )
            how = "percentile"
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Delta(
        value, low, high, kind, n, f"paired bootstrap over {n} documents ({resamples:,} resamples, {how}, seed {seed})"
    )


def _jackknife_t(data: tuple, statistic, whole: float, log_ratio: bool, confidence: float) -> tuple[float, float]:
    """The t-interval (n - 1 degrees of freedom) around ``whole``, the statistic of all of ``data``, with the
    jackknife's standard error: the statistic recomputed without each document in turn (on log(1 + x)
    where ``log_ratio``)."""
    import scipy.stats  # scipy.stats: imported at first use (it takes ~1.5 s to import)

    n = len(data[0])
    keep = ~np.eye(n, dtype=bool)  # row i: every document but i
    loo = np.asarray(statistic(*(np.asarray(c)[None, :].repeat(n, 0)[keep].reshape(n, n - 1) for c in data)))
    link, back = (np.log1p, np.expm1) if log_ratio else (lambda x: x, lambda x: x)
    centre, loo = link(whole), link(loo)
    se = math.sqrt((n - 1) / n * float(((loo - loo.mean()) ** 2).sum()))
    half = float(scipy.stats.t.ppf((1 + confidence) / 2, n - 1)) * se
    return float(back(centre - half)), float(back(centre + half))


def _same_documents(reference: dict, docs: dict, what: str) -> None:
    if list(reference["ids"]) != list(docs["ids"]):
        raise ValueError(
            f"{what} cover different documents ({len(reference['ids'])} vs {len(docs['ids'])} ids, first "
            f"difference at {_first_difference(reference['ids'], docs['ids'])}): evaluate them on the same "
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
    float_docs: dict | None = None,
    quant_docs: dict | None = None,
) -> Delta | None:
    """The change of ``metric``: with its paired interval where both evaluations kept per-document
    values, else the point change from the two aggregates, without an interval; None without both values."""
    if float_value is None or quant_value is None:
        return None
    if float_docs and quant_docs and metric in METRICS:
        return paired_delta(float_docs, quant_docs, metric)
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
    return f"{fmt(d.value * scale)}{unit} {interval}" + (noise if d.within_noise else "")


def table_head(columns: list[str]) -> list[str]:
    """A markdown table's header: the column names and the rule under them."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


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
    return f"{fmt(1 + d.value)}x {interval}" + (noise if d.within_noise else "")


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
