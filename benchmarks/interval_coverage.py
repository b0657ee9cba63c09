"""How often quantgate's 95% intervals hold the true change: their coverage, measured with the truth known.

    python benchmarks/interval_coverage.py                 # 2,000 replicates per row (Monte Carlo s.e. 0.005)
    python benchmarks/interval_coverage.py --reps 200      # a quick look

Each replicate draws n documents, computes the change of word perplexity with ``quantgate.stats.paired_delta``
(the code every report uses) and checks whether its interval holds the truth. Two kinds of data:

* synthetic documents with the truth set: lengths equal (1,000 words) or log-normal like the bundled corpus
  (median 1,100 words, sigma 1); each document's damage (its log perplexity ratio per word) is 0.05 plus a
  document effect (normal: per-document perplexity ratios log-normal, with sigma 0.025, 0.5 or 1; or itself
  log-normal, centred on 0: a skewed damage, a few documents hurt far more) plus token noise that
  falls as one over the root of its words; in the ``works`` rows documents come in turn from up to 9 works,
  each with its own skewed effect, and the interval resamples works;
* the committed per-document values of the main job's SmolLM2 cell (results/quickstart, 24 documents in 9
  works, five schemes) resampled as the population: documents with replacement (the truth: the change over
  all 24), and works with replacement, a document of the drawn work per slot (the truth: the change of the
  two-stage population, each work's mean per document).

A row reads ``approximate`` where quantgate marks the intervals approximate (fewer than
``quantgate.stats.MIN_CLUSTERS`` clusters), ``below`` where it does not and the coverage is under 0.94.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from quantgate.stats import MIN_CLUSTERS, paired_delta

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "results" / "quickstart" / "metrics.json"
NS = (4, 8, 12, 24)
TARGET = 0.94
MEAN_DAMAGE = 0.05  # the true log perplexity ratio per word of the synthetic rows
WORKS = 9  # the bundled test split's works


def _docs(d: np.ndarray, words: np.ndarray, works: list[str] | None) -> tuple[dict, dict]:
    """A float and a quantized evaluation whose per-word log ratio is ``d``."""
    ids = list(range(len(d)))
    flt = {"ids": ids, "loglikelihood": list(-3.0 * words), "words": list(words)}
    qnt = {"ids": ids, "loglikelihood": list(-3.0 * words - d * words), "words": list(words)}
    if works is not None:
        flt["works"] = qnt["works"] = works
    return flt, qnt


def synthetic(lengths: str, effect: str, clustered: bool):
    """A sampler of n documents (float docs, quantized docs) with log ratio MEAN_DAMAGE in the population."""

    def draw(rng: np.random.Generator, n: int) -> tuple[dict, dict]:
        words = np.full(n, 1000.0) if lengths == "equal" else np.round(np.exp(rng.normal(7.0, 1.0, n))) + 20
        if effect == "normal":
            doc = rng.normal(0, 0.025, n)
        elif effect.startswith("ratio"):  # log-normal per-document perplexity ratios: a normal log ratio
            doc = rng.normal(0, float(effect.split()[1]), n)
        else:  # log-normal, centred: skewed to the right
            sigma = {"skewed": 0.5, "very skewed": 1.0}[effect]
            doc = 0.05 * (np.exp(rng.normal(0, sigma, n)) - math.exp(sigma**2 / 2))
        noise = rng.normal(0, 2.0, n) / np.sqrt(words)
        works = None
        if clustered:
            g = min(n, WORKS)
            slot = np.arange(n) % g
            work_effect = 0.03 * (np.exp(rng.normal(0, 0.5, g)) - math.exp(0.125))
            doc = doc + work_effect[slot]
            works = [f"work {i}" for i in slot]
        return _docs(MEAN_DAMAGE + doc + noise, words, works)

    return draw, MEAN_DAMAGE


def resampled(scheme: str, by_work: bool):
    """A sampler of n documents from the main job's SmolLM2 cell under ``scheme``, and the population's truth."""
    cell = next(c for c in json.loads(MAIN_JOB.read_text())["cells"] if c["model"] == "smollm2-135m")
    task = next(t for t in ("quantgate_passages", "quantgate_ppl") if t in cell["float_documents"])
    f = cell["float_documents"][task]
    q = cell["schemes"][scheme]["documents"][task]
    words = np.asarray(f["words"], dtype=np.float64)
    d = (np.asarray(f["loglikelihood"]) - np.asarray(q["loglikelihood"])) / words
    works = np.asarray(f["works"])
    names = sorted(set(f["works"]))
    members = {w: np.flatnonzero(works == w) for w in names}
    if by_work:  # two-stage: a work, then one of its documents; each work's mean per document
        truth = sum((words[m] * d[m]).mean() for m in members.values()) / sum(words[m].mean() for m in members.values())
    else:
        truth = float((words * d).sum() / words.sum())

    def draw(rng: np.random.Generator, n: int) -> tuple[dict, dict]:
        if not by_work:
            i = rng.integers(0, len(d), n)
            return _docs(d[i], words[i], None)
        g = min(n, len(names))
        chosen = rng.integers(0, len(names), g)
        slot = np.arange(n) % g
        i = np.array([rng.choice(members[names[chosen[s]]]) for s in slot])
        return _docs(d[i], words[i], [f"draw {s}" for s in slot])  # a work drawn twice is two clusters

    return draw, truth


def coverage(draw, truth: float, n: int, reps: int, seed: int) -> tuple[float, float, bool]:
    """(coverage, median width in points of log ratio, approximate?) over ``reps`` replicates of n documents."""
    rng = np.random.default_rng(seed)
    hits, widths, approximate = 0, [], False
    for _ in range(reps):
        flt, qnt = draw(rng, n)
        delta = paired_delta(flt, qnt, "word_perplexity", seed=int(rng.integers(1 << 31)))
        assert delta.low is not None and delta.high is not None
        with np.errstate(divide="ignore"):  # a lower end of -100% (a bootstrap-t without bound): -inf
            low, high = (float(np.log1p(x)) for x in (delta.low, delta.high))
        hits += low <= truth <= high
        widths.append(high - low)
        approximate |= delta.approximate
    return hits / reps, float(np.median(widths)), approximate


def rows(reps: int, schemes: list[str]) -> list[tuple[str, int, float, float, bool]]:
    """(data, n, coverage, median width, approximate) for every data set and n."""
    data = {
        "synthetic: equal lengths, normal damage": synthetic("equal", "normal", False),
        "synthetic: unequal lengths, log-normal per-document ratios (sigma 0.5)": synthetic(
            "unequal", "ratio 0.5", False
        ),
        "synthetic: unequal lengths, log-normal per-document ratios (sigma 1)": synthetic("unequal", "ratio 1", False),
        "synthetic: unequal lengths, skewed damage (log-normal sigma 0.5)": synthetic("unequal", "skewed", False),
        "synthetic: unequal lengths, very skewed damage (log-normal sigma 1)": synthetic(
            "unequal", "very skewed", False
        ),
        "synthetic: 9 works, unequal lengths, skewed work and document effects": synthetic("unequal", "skewed", True),
    }
    for scheme in schemes:
        data[f"SmolLM2 {scheme}, documents resampled"] = resampled(scheme, False)
        data[f"SmolLM2 {scheme}, works resampled"] = resampled(scheme, True)
    out = []
    with tqdm(total=len(data) * len(NS), desc="coverage", unit="row") as bar:
        for k, (name, (draw, truth)) in enumerate(data.items()):
            for n in NS:
                out.append((name, n, *coverage(draw, truth, n, reps, seed=1000 * k + n)))
                bar.update()
    return out


def table(result: list[tuple[str, int, float, float, bool]], reps: int) -> str:
    """The coverage page: its command, the table, and the rows that miss the target without being marked."""
    se = math.sqrt(TARGET * (1 - TARGET) / reps)
    lines = [
        "# Coverage of quantgate's 95% intervals",
        "",
        f"Command: `python benchmarks/interval_coverage.py --reps {reps} --out results/bench/interval_coverage.md` "
        f"(the data and the truth: the script's docstring). {reps:,} replicates per row, Monte Carlo standard "
        f"error {se:.3f} at {TARGET}; target >= {TARGET}. Below {MIN_CLUSTERS} clusters (works, or documents where "
        "none is recorded) quantgate marks an interval approximate and draws no verdict from it.",
        "",
        "| data | n | coverage | median width (log ratio) | reads |",
        "|---|---|---|---|---|",
    ]
    for name, n, cov, width, approximate in result:
        reads = "approximate" if approximate else "ok" if cov >= TARGET else "below"
        lines.append(f"| {name} | {n} | {cov:.3f} | {width:.4f} | {reads} |")
    below = [r for r in result if r[2] < TARGET and not r[4]]
    marked = [r for r in result if r[4]]
    lines += [
        "",
        f"Rows at or above {TARGET}: {sum(r[2] >= TARGET for r in result)} of {len(result)}; marked approximate: "
        f"{len(marked)} (their coverage: {', '.join(f'{r[2]:.3f}' for r in marked) or 'none'}).",
        f"Rows below {TARGET} and not marked approximate: {len(below)}"
        + (": " + "; ".join(f"{r[0]}, n = {r[1]} ({r[2]:.3f})" for r in below) if below else "")
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000, help="replicates per row (default 2,000)")
    ap.add_argument(
        "--schemes",
        default="w8a8-int8-dynamic,w8a8-int8-static,w8a8-int8-static:rotate=online",
        help="comma-separated main-job schemes to resample",
    )
    ap.add_argument("--out", help="write the page here as well (results/bench/interval_coverage.md)")
    args = ap.parse_args(argv)
    page = table(rows(args.reps, args.schemes.split(",")), args.reps)
    print(page, end="")
    if args.out:
        Path(args.out).write_text(page)


if __name__ == "__main__":
    main()
