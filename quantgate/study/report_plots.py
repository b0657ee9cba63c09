"""A study's plots (matplotlib, PNG), from its cells: per-layer outliers and sinks, float vs quantized
perplexity, activation-bit sweeps, outlier emergence over training, and the "Which fix?" ranking."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker

from ..observe_records import LayerRow
from ..plots import save_png
from ..stats import Delta
from .measures import ppl_of
from .records import CellRecord

__all__ = ["plot_study_layers", "plot_study_quant", "plot_bit_sweeps", "plot_study_training", "plot_fixes"]


def _cell_colors(cells: list[CellRecord]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {c.id: cmap(i % 10) for i, c in enumerate(cells)}


def plot_study_layers(cells: list[CellRecord], path: Path) -> Path:
    """Per cell and layer: residual max |x|, max / median, first-token attention, gate mean."""
    colors = _cell_colors(cells)
    panels: list[tuple[Callable[[LayerRow], float | None], str, str]] = [
        (lambda L: L.max_activation, "residual max |x|", "log"),
        (lambda L: L.max_median_ratio, "max / median |x|", "log"),
        (lambda L: L.sink_mass, "first-token attention", "linear"),
        (lambda L: L.gate_mean, "gate mean", "linear"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 3.8))
    for ax, (value, label, scale) in zip(axes, panels, strict=True):
        for c in cells:
            ys = [value(L) for L in c.layers]
            if any(y is not None for y in ys):
                ax.plot(
                    range(len(ys)),
                    [float("nan") if y is None else y for y in ys],
                    marker=".",
                    label=c.id,
                    color=colors[c.id],
                )
        ax.set(xlabel="layer", title=label, yscale=scale)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return save_png(fig, Path(path))


def plot_study_quant(cells: list[CellRecord], schemes: list[str], path: Path) -> Path:
    """Headline perplexity per cell: float and each scheme (log scale)."""
    columns = ["float", *schemes]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cells) * len(columns) / 3), 4.2))
    width = 0.8 / len(columns)
    cmap = plt.get_cmap("tab10")
    for j, col in enumerate(columns):
        ys = []
        for c in cells:
            res = c.float_results if col == "float" else c.scheme(col).results
            v = ppl_of(res)
            ys.append(float("nan") if v is None else v)
        ax.bar([i + j * width for i in range(len(cells))], ys, width, label=col, color=cmap(j % 10))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [c.id for c in cells], fontsize=7, rotation=20)
    ax.set(yscale="log", ylabel="perplexity", title="held-out perplexity, float vs quantized")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, Path(path))


def plot_bit_sweeps(
    sweeps: dict[str, list[tuple[int, dict[str, Delta | None]]]], cell_ids: list[str], budget: float, path: Path
) -> Path:
    """Perplexity ratio (quantized / float, log scale) vs activation bits, one line per cell swept at two
    widths or more (error bars: the 95% intervals), one panel per swept scheme; ``sweeps``:
    ``{base: [(bits, {cell id: Delta or None}), ...]}``."""
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4.2), squeeze=False)
    for ax, (base, points) in zip(axes[0], sweeps.items(), strict=True):
        for cid in cell_ids:
            pts = [(b, d) for b, ds in points if (d := ds.get(cid)) is not None]
            if len(pts) < 2:  # a model quantized at one width only has no sweep to draw
                continue
            xs, ys = [b for b, _ in pts], [1 + d.value for _, d in pts]
            err = [
                [d.value - d.low if d.low is not None else 0 for _, d in pts],
                [d.high - d.value if d.high is not None else 0 for _, d in pts],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=cid)
        ax.axhline(1 + budget, color="grey", linestyle="--", linewidth=1, label=f"+{budget:.0%} budget")
        ax.set(xlabel="activation bits", ylabel="perplexity ratio, quantized / float (log)", title=base)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xticks(sorted({b for b, _ in points}))
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, Path(path))


def plot_study_training(cells: list[CellRecord], path: Path) -> Path:
    """Outlier emergence over training: loss, largest residual activation, first-token attention."""
    colors = _cell_colors(cells)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for c in cells:
        if not c.is_trained:
            continue
        t = c.trained
        col = colors[c.id]
        axes[0].plot([r.step for r in t.curve], [r.loss for r in t.curve], color=col, label=c.id, lw=1)
        obs = t.observe_curve
        axes[1].plot([r.step for r in obs], [r.max_activation for r in obs], marker=".", color=col)
        axes[2].plot([r.step for r in obs], [r.sink_mass for r in obs], marker=".", color=col)
    axes[0].set(xlabel="step", ylabel="train loss", title="loss")
    axes[1].set(xlabel="step", title="largest residual activation", yscale="log")
    axes[2].set(xlabel="step", title="mean first-token attention")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return save_png(fig, Path(path))


def plot_fixes(changes: dict[str, dict[str, Delta | None]], within: float, path: Path) -> Path:
    """Perplexity change (%, symmetric log scale: linear within +-1%) per scheme, one bar per model, with the
    95% intervals and the ``within`` line; ``changes``: ``{model: {scheme: Delta or None}}``, schemes ordered
    best first on the first model."""
    models = list(changes)
    first = changes[models[0]]
    schemes = sorted(first, key=lambda s: float("inf") if (d := first[s]) is None else d.value)
    fig, ax = plt.subplots(figsize=(8.0, 0.32 * len(schemes) + 1.6))
    height = 0.8 / len(models)
    cmap = plt.get_cmap("tab10")
    for j, model in enumerate(models):
        ds = [changes[model].get(s) for s in schemes]
        xs = [float("nan") if d is None else 100 * d.value for d in ds]
        err = [
            [0 if d is None or d.low is None else 100 * (d.value - d.low) for d in ds],
            [0 if d is None or d.high is None else 100 * (d.high - d.value) for d in ds],
        ]
        ax.barh(
            [i + j * height for i in range(len(schemes))],
            xs,
            height,
            xerr=err,
            label=model,
            color=cmap(j % 10),
            error_kw={"elinewidth": 0.8},
        )
    ax.axvline(100 * within, color="k", linestyle="--", linewidth=0.8, label=f"+{within:.0%}")
    ax.set_yticks([i + (len(models) - 1) * height / 2 for i in range(len(schemes))], schemes, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set(xlabel="perplexity change, quantized vs float (%; log beyond +-1%)", title="which fix? (95% intervals)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_png(fig, Path(path))
