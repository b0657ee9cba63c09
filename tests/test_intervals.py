"""One interval rule for every delta (issue 32): a BCa paired bootstrap from MIN_BOOTSTRAP_UNITS documents
on, a jackknife t-interval (n - 1 df, on the log ratio for a perplexity) below; a paired difference of two
models' changes on the same documents. Each checked against a hand computation."""

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from quantgate.stats import MIN_BOOTSTRAP_UNITS, format_delta, interval_method, paired_delta, paired_difference
from quantgate.study import read_metrics
from quantgate.study.measures import ppl_change
from quantgate.study.report import study_markdown


def _docs(n: int, seed: int, cost: float = 0.1):
    """Float and quantized per-document values of a perplexity task: n documents of 100-1000 tokens whose
    quantized log-likelihood is lower by ``cost`` nats per token, give or take."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(100, 1000, n).astype(float)
    ll = -tokens * rng.uniform(3, 4, n)
    quant = ll - tokens * rng.uniform(0.5 * cost, 1.5 * cost, n)
    ids = list(range(n))
    as_docs = lambda v: {"ids": ids, "loglikelihood": v.tolist(), "tokens": tokens.tolist()}
    return as_docs(ll), as_docs(quant), tokens


def _jackknife_t(stat, n: int, log: bool):
    """By hand: the statistic without each document in turn, its jackknife standard error, t(n - 1)."""
    whole = stat(list(range(n)))
    loo = np.array([stat([j for j in range(n) if j != i]) for i in range(n)])
    if log:
        whole, loo = math.log1p(whole), np.log1p(loo)
    se = math.sqrt((n - 1) / n * ((loo - loo.mean()) ** 2).sum())
    t = scipy.stats.t.ppf(0.975, n - 1)
    back = math.expm1 if log else float
    return back(whole - t * se), back(whole + t * se)


def _ppl_change(f, q, w):
    return lambda idx: math.expm1((np.take(f, idx).sum() - np.take(q, idx).sum()) / np.take(w, idx).sum())


@pytest.mark.parametrize("n", [2, 4, 12, MIN_BOOTSTRAP_UNITS - 1])
def test_a_change_over_few_documents_gets_the_jackknife_t_interval(n):
    f, q, w = _docs(n, seed=n)
    d = paired_delta(f, q, "perplexity")
    change = _ppl_change(np.array(f["loglikelihood"]), np.array(q["loglikelihood"]), w)
    assert d.value == pytest.approx(change(list(range(n))), rel=1e-12)
    assert (d.low, d.high) == pytest.approx(_jackknife_t(change, n, log=True), rel=1e-9)
    assert d.method.startswith(f"jackknife t-interval over {n} documents ({n - 1} df, on the log ratio")
    assert d.low is not None and d.low > -1  # a log-ratio interval never reaches a perplexity of 0


def test_from_the_minimum_on_the_interval_is_bca():
    f, q, _ = _docs(MIN_BOOTSTRAP_UNITS, seed=0)
    d = paired_delta(f, q, "perplexity")
    assert "BCa" in d.method and d.n == MIN_BOOTSTRAP_UNITS
    assert interval_method(1) == "none" and interval_method(19) == "jackknife-t" and interval_method(20) == "BCa"


def test_at_four_documents_the_interval_is_wider_than_bca():
    """The reason for the rule: at n = 4 a BCa bootstrap of the same change (computed here with scipy) is
    narrower than the jackknife t-interval quantgate now reports."""
    f, q, w = _docs(4, seed=3)
    t = paired_delta(f, q, "perplexity")
    cols = (np.array(f["loglikelihood"]), np.array(q["loglikelihood"]), w)
    res = scipy.stats.bootstrap(
        cols,
        lambda a, b, c, axis=-1: np.expm1((a.sum(axis) - b.sum(axis)) / c.sum(axis)),
        paired=True,
        vectorized=True,
        n_resamples=1000,
        rng=0,
    )
    assert t.high is not None and t.low is not None
    assert t.high - t.low > res.confidence_interval.high - res.confidence_interval.low


@pytest.mark.parametrize("n", [6, 24])
def test_paired_difference_of_two_models_changes_by_hand(n):
    """The gated twin's change minus the ungated twin's, on the same documents: the value is the difference
    of the two changes; below the minimum its interval is the jackknife t-interval of that difference."""
    f_u, q_u, w = _docs(n, seed=1, cost=0.12)
    rng = np.random.default_rng(7)
    f_g = {**f_u, "loglikelihood": (np.array(f_u["loglikelihood"]) - w * rng.uniform(0, 0.02, n)).tolist()}
    q_g = {**f_u, "loglikelihood": (np.array(f_g["loglikelihood"]) - w * rng.uniform(0.02, 0.08, n)).tolist()}
    d = paired_difference((f_u, q_u), (f_g, q_g), "perplexity")
    cols = [np.array(x["loglikelihood"]) for x in (f_u, q_u, f_g, q_g)]

    def gap(idx):
        return _ppl_change(cols[2], cols[3], w)(idx) - _ppl_change(cols[0], cols[1], w)(idx)

    assert d.value == pytest.approx(gap(list(range(n))), rel=1e-12)
    assert d.value == pytest.approx(
        paired_delta(f_g, q_g, "perplexity").value - paired_delta(f_u, q_u, "perplexity").value
    )
    assert d.kind == "points" and format_delta(d).startswith(f"{100 * d.value:+.1f} pp [")
    if n < MIN_BOOTSTRAP_UNITS:
        assert (d.low, d.high) == pytest.approx(_jackknife_t(gap, n, log=False), rel=1e-9)
    else:
        assert "BCa" in d.method
    assert d.high is not None and d.high < 0  # the gated twin loses less on every document here


def test_a_paired_difference_refuses_documents_that_differ():
    f, q, _ = _docs(5, seed=0)
    other = {**f, "ids": [0, 1, 2, 3, 9]}
    with pytest.raises(ValueError, match="the four evaluations of a paired difference cover different documents"):
        paired_difference((f, q), (other, q), "perplexity")


def test_an_accuracy_difference_is_a_plain_paired_t_interval_below_the_minimum():
    """For an accuracy (no weights) the jackknife t-interval of a mean is the paired t-interval exactly."""
    rng = np.random.default_rng(5)
    n = 10
    a, b = rng.integers(0, 2, n), rng.integers(0, 2, n)
    d = paired_delta({"ids": list(range(n)), "acc": a.tolist()}, {"ids": list(range(n)), "acc": b.tolist()}, "acc")
    diff = (b - a).astype(float)
    half = scipy.stats.t.ppf(0.975, n - 1) * diff.std(ddof=1) / math.sqrt(n)
    assert (d.value, d.low, d.high) == pytest.approx((diff.mean(), diff.mean() - half, diff.mean() + half))


def test_paired_difference_at_ratio_scale_is_a_ratio_of_ratios_by_hand():
    """Where a perplexity grew 10x or more, the difference of two changes is the ratio of the two perplexity
    ratios (minus 1), with its jackknife t-interval on the log below the minimum: by hand."""
    n = 8
    f_u, q_u, w = _docs(n, seed=2, cost=5.0)  # ~e^5 = 150x
    shift = w * np.random.default_rng(3).uniform(0.5, 1.5, n)  # about 1 nat per token less: ~e^-1 of that ratio
    q_g = {**q_u, "loglikelihood": (np.array(q_u["loglikelihood"]) + shift).tolist()}
    d = paired_difference((f_u, q_u), (f_u, q_g), "perplexity")
    cols = [np.array(x["loglikelihood"]) for x in (f_u, q_u, q_g)]

    def ratio_of_ratios(idx):
        return (1 + _ppl_change(cols[0], cols[2], w)(idx)) / (1 + _ppl_change(cols[0], cols[1], w)(idx)) - 1

    assert d.kind == "ratio"
    assert d.value == pytest.approx(math.expm1(-shift.sum() / w.sum()), rel=1e-9)
    assert d.value == pytest.approx(ratio_of_ratios(list(range(n))), rel=1e-9)
    assert (d.low, d.high) == pytest.approx(_jackknife_t(ratio_of_ratios, n, log=True), rel=1e-9)
    assert d.high is not None and d.high < 0 and format_delta(d).startswith(f"{1 + d.value:.2f}x [")
    small = paired_difference(_docs(n, seed=2, cost=0.1)[:2], _docs(n, seed=2, cost=0.1)[:2], "perplexity")
    assert small.kind == "points"  # below 10x the difference stays in points


ROOT = Path(__file__).resolve().parents[1]
COMMITTED_RUNS = sorted(
    p.parent for p in (ROOT / "results").rglob("config.yaml") if (p.parent / "metrics.json").is_file()
)


def test_the_main_jobs_smollm2_numbers_rest_on_24_documents_from_3_works_with_bca():
    """The committed main job (results/quickstart): every SmolLM2 evaluation reads the same >= 24 whole test
    documents from >= 3 works, so its changes take BCa intervals; the twins' 8 x 16 backcopy sequences too."""
    metrics = read_metrics(ROOT / "results" / "quickstart")
    smol = next(c for c in metrics.cells if c.model == "smollm2-135m")
    docs = smol.float_documents["quantgate_ppl"]
    assert len(docs["ids"]) >= 24 and len(set(docs["works"])) >= 3
    for scheme, record in smol.schemes.items():
        assert record.documents["quantgate_ppl"]["ids"] == docs["ids"], scheme
        change = ppl_change(smol, scheme)
        assert change is not None and change.method.startswith(f"paired bootstrap over {len(docs['ids'])} documents")


@pytest.mark.parametrize("run", COMMITTED_RUNS, ids=lambda p: str(p.relative_to(ROOT / "results")))
def test_committed_study_reports_are_what_the_interval_rule_makes_of_their_metrics(run):
    """Every committed study report is the current code's rendering of its metrics.json: its intervals follow the
    one rule (BCa only from MIN_BOOTSTRAP_UNITS documents on) and its verdicts come from paired differences."""
    metrics = read_metrics(run)
    assert study_markdown(metrics) == (run / "report.md").read_text(), f"quantgate report {run.relative_to(ROOT)}"
    for cell in metrics.cells:
        for scheme in cell.schemes:
            d = ppl_change(cell, scheme)
            if d is not None and d.low is not None:
                assert d.method.startswith("paired bootstrap") == (d.n >= MIN_BOOTSTRAP_UNITS), d.method
