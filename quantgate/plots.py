"""Plots (matplotlib, PNG) for observe reports, training logs and tables of runs (a study's own plots:
:mod:`quantgate.study.report_plots`)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .files import write_bytes_atomic

if TYPE_CHECKING:
    from .observe_records import LayerSummary, ObserveMeta

__all__ = ["plot_observe", "bar_panels", "save_png"]


def plot_observe(layers: list[LayerSummary], meta: ObserveMeta, out: Path) -> list[Path]:
    """An observe report's plots (its ``layers`` and ``meta``): per-layer max |x| and kurtosis; layer x head
    sink-mass heatmap; gate histograms."""
    out = Path(out)
    idx = list(range(len(layers)))
    paths = []
    title = f"{meta.model or meta.family} ({meta.variant})"

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in ("block_out", "attn_out", "ffn_out"):
        if all(name in L.tensors for L in layers):
            ax1.plot(idx, [L.tensors[name].max_abs for L in layers], marker="o", ms=3, label=name)
            ax2.plot(idx, [L.tensors[name].kurtosis or float("nan") for L in layers], marker="o", ms=3, label=name)
    ax1.set(yscale="log", xlabel="layer", ylabel="max |x|", title="largest activation")
    ax2.set(yscale="log", xlabel="layer", ylabel="kurtosis (Gaussian = 3)", title="kurtosis")
    ax2.axhline(3, color="grey", lw=0.8, ls="--")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.append(save_png(fig, out / "observe_layers.png"))

    sinks = [L.sink.per_head for L in layers if L.sink]
    if sinks:
        fig, ax = plt.subplots(figsize=(max(4, 0.35 * len(sinks[0]) + 2), max(3, 0.25 * len(sinks) + 1.5)))
        im = ax.imshow(sinks, vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set(xlabel="head", ylabel="layer", title=f"attention on the first {meta.sink_tokens} key(s)")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        paths.append(save_png(fig, out / "observe_sink.png"))

    gates = [(i, L.gate) for i, L in enumerate(layers) if L.gate]
    if gates:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        cmap = plt.get_cmap("viridis")
        for i, g in gates:
            bins = len(g.hist)
            ax.plot(
                [(b + 0.5) / bins for b in range(bins)],
                g.hist,
                color=cmap(i / max(len(layers) - 1, 1)),
                label=f"layer {i}" if len(gates) <= 8 else None,
            )
        ax.set(xlabel="gate value", ylabel="share", title="gate histograms (colour = layer)")
        if len(gates) <= 8:
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(save_png(fig, out / "observe_gates.png"))
    return paths


def save_png(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, 110 dpi; whole or not at all, never through a link) and close it."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(path, png.getvalue())


def bar_panels(panels: dict[str, list[tuple[str, float | None]]], path: Path, title: str = "") -> Path:
    """One bar chart per metric: ``{metric: [(label, value), ...]}``."""
    n = len(panels)
    labels = max((len(v) for v in panels.values()), default=1)
    fig, axes = plt.subplots(1, n, figsize=(max(4.0, 0.55 * labels + 1.5) * n, 4.2), squeeze=False)
    for ax, (metric, items) in zip(axes[0], panels.items(), strict=True):
        items = [(label, v) for label, v in items if v is not None]
        ax.bar(range(len(items)), [v for _, v in items], color="tab:blue")
        ax.set_xticks(range(len(items)), [label for label, _ in items], fontsize=6, rotation=90)
        ax.set_title(metric, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_png(fig, Path(path))
