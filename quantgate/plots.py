"""Plots (matplotlib, PNG) for observe reports and studies."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

__all__ = ["plot_observe", "bar_panels", "plot_training", "plot_study_layers", "plot_study_quant", "plot_bit_sweeps",
           "plot_study_training"]


def plot_observe(report, out: Path) -> list[Path]:
    """Per-layer max |x| and kurtosis; layer x head sink-mass heatmap; gate histograms."""
    out = Path(out)
    layers = report.layers
    idx = list(range(len(layers)))
    paths = []
    title = f"{report.meta.get('model') or report.meta['family']} ({report.meta['variant']})"

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in ("block_out", "attn_out", "ffn_out"):
        if all(name in L["tensors"] for L in layers):
            ax1.plot(idx, [L["tensors"][name]["max_abs"] for L in layers], marker="o", ms=3, label=name)
            ax2.plot(idx, [L["tensors"][name]["kurtosis"] or float("nan") for L in layers], marker="o", ms=3,
                     label=name)
    ax1.set(yscale="log", xlabel="layer", ylabel="max |x|", title="largest activation")
    ax2.set(yscale="log", xlabel="layer", ylabel="kurtosis (Gaussian = 3)", title="kurtosis")
    ax2.axhline(3, color="grey", lw=0.8, ls="--")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.append(_save(fig, out / "observe_layers.png"))

    sinks = [L["sink"]["per_head"] for L in layers if L.get("sink")]
    if sinks:
        fig, ax = plt.subplots(figsize=(max(4, 0.35 * len(sinks[0]) + 2), max(3, 0.25 * len(sinks) + 1.5)))
        im = ax.imshow(sinks, vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set(xlabel="head", ylabel="layer", title=f"attention on the first {report.meta['sink_tokens']} key(s)")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        paths.append(_save(fig, out / "observe_sink.png"))

    gates = [(i, L["gate"]) for i, L in enumerate(layers) if L.get("gate")]
    if gates:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        cmap = plt.get_cmap("viridis")
        for i, g in gates:
            bins = len(g["hist"])
            ax.plot([(b + 0.5) / bins for b in range(bins)], g["hist"], color=cmap(i / max(len(layers) - 1, 1)),
                    label=f"layer {i}" if len(gates) <= 8 else None)
        ax.set(xlabel="gate value", ylabel="share", title="gate histograms (colour = layer)")
        if len(gates) <= 8:
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out / "observe_gates.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_panels(panels: dict[str, list[tuple[str, float | None]]], path: Path, title: str = "") -> Path:
    """One bar chart per metric: ``{metric: [(label, value), ...]}``."""
    n = len(panels)
    labels = max((len(v) for v in panels.values()), default=1)
    fig, axes = plt.subplots(1, n, figsize=(max(4.0, 0.55 * labels + 1.5) * n, 4.2), squeeze=False)
    for ax, (metric, items) in zip(axes[0], panels.items()):
        items = [(label, v) for label, v in items if v is not None]
        ax.bar(range(len(items)), [v for _, v in items], color="tab:blue")
        ax.set_xticks(range(len(items)), [label for label, _ in items], fontsize=6, rotation=90)
        ax.set_title(metric, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_training(log_path: Path, path: Path) -> Path | None:
    """Outlier emergence over training from a trainer's log.jsonl: loss, residual max |x|, first-token
    attention and gate mean per layer against steps."""
    import json

    records = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    obs = [r for r in records if r["event"] == "observe"]
    if not train:
        return None
    gated = any(L.get("gate_mean") is not None for r in obs for L in r["layers"])
    panels = 4 if gated else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["loss"] for r in evals], marker="o", label="held-out")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend(fontsize=8)
    if obs:
        n_layers = len(obs[0]["layers"])
        cmap = plt.get_cmap("viridis")
        keys = [("max_abs", "residual max |x|", "log"), ("sink_mass", "first-token attention", "linear")]
        if gated:
            keys.append(("gate_mean", "gate mean", "linear"))
        for ax, (key, label, scale) in zip(axes[1:], keys):
            for i in range(n_layers):
                ys = [r["layers"][i][key] for r in obs]
                if any(y is not None for y in ys):
                    ax.plot([r["step"] for r in obs], [float("nan") if y is None else y for y in ys], marker=".",
                            color=cmap(i / max(n_layers - 1, 1)), label=f"layer {i}" if n_layers <= 8 else None)
            ax.set(xlabel="step", title=label, yscale=scale)
        if n_layers <= 8:
            axes[1].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, Path(path))


def _cell_colors(cells):
    cmap = plt.get_cmap("tab10")
    return {c["id"]: cmap(i % 10) for i, c in enumerate(cells)}


def plot_study_layers(cells: list[dict], path: Path) -> Path:
    """Per cell and layer: residual max |x|, max / median, first-token attention, gate mean."""
    colors = _cell_colors(cells)
    keys = [("max_activation", "residual max |x|", "log"), ("max_median_ratio", "max / median |x|", "log"),
            ("sink_mass", "first-token attention", "linear"), ("gate_mean", "gate mean", "linear")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.3 * len(keys), 3.8))
    for ax, (key, label, scale) in zip(axes, keys):
        for c in cells:
            ys = [L.get(key) for L in c["observe"]["layers"]]
            if any(y is not None for y in ys):
                ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], marker=".", label=c["id"],
                        color=colors[c["id"]])
        ax.set(xlabel="layer", title=label, yscale=scale)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_study_quant(cells: list[dict], schemes: list[str], ppl_of, path: Path) -> Path:
    """Perplexity per cell (``ppl_of(results)``): float and each scheme (log scale)."""
    columns = ["float", *schemes]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cells) * len(columns) / 3), 4.2))
    width = 0.8 / len(columns)
    cmap = plt.get_cmap("tab10")
    for j, col in enumerate(columns):
        ys = []
        for c in cells:
            res = c["float"] if col == "float" else (c["schemes"].get(col) or {}).get("results")
            v = ppl_of(res)
            ys.append(float("nan") if v is None else v)
        ax.bar([i + j * width for i in range(len(cells))], ys, width, label=col, color=cmap(j % 10))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], [c["id"] for c in cells], fontsize=7, rotation=20)
    ax.set(yscale="log", ylabel="perplexity", title="held-out perplexity, float vs quantized")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_bit_sweeps(sweeps: dict, cell_ids: list[str], budget: float, path: Path) -> Path:
    """Perplexity ratio (quantized / float, log scale) vs activation bits, one line per cell swept at two
    widths or more (error bars: the 95% intervals), one panel per swept scheme; ``sweeps``:
    ``{base: [(bits, {cell id: Delta or None}), ...]}``."""
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4.2), squeeze=False)
    for ax, (base, points) in zip(axes[0], sweeps.items()):
        for cid in cell_ids:
            pts = [(b, d[cid]) for b, d in points if d.get(cid) is not None]
            if len(pts) < 2:  # a model quantized at one width only has no sweep to draw
                continue
            xs, ys = [b for b, _ in pts], [1 + d.value for _, d in pts]
            err = [[d.value - d.low if d.low is not None else 0 for _, d in pts],
                   [d.high - d.value if d.high is not None else 0 for _, d in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=cid)
        ax.axhline(1 + budget, color="grey", linestyle="--", linewidth=1, label=f"+{budget:.0%} budget")
        ax.set(xlabel="activation bits", ylabel="perplexity ratio, quantized / float (log)", title=base)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xticks(sorted({b for b, _ in points}))
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_study_training(cells: list[dict], path: Path) -> Path:
    """Outlier emergence over training: loss, largest residual activation, first-token attention."""
    colors = _cell_colors(cells)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for c in cells:
        t = c["trained"]
        if not t.get("trained"):
            continue
        col = colors[c["id"]]
        axes[0].plot([r["step"] for r in t["curve"]], [r["loss"] for r in t["curve"]], color=col, label=c["id"], lw=1)
        obs = t.get("observe_curve") or []
        axes[1].plot([r["step"] for r in obs], [r["max_activation"] for r in obs], marker=".", color=col)
        axes[2].plot([r["step"] for r in obs], [r["sink_mass"] for r in obs], marker=".", color=col)
    axes[0].set(xlabel="step", ylabel="train loss", title="loss")
    axes[1].set(xlabel="step", title="largest residual activation", yscale="log")
    axes[2].set(xlabel="step", title="mean first-token attention")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_fixes(changes: dict[str, dict], within: float, path: Path) -> Path:
    """Perplexity change (%, symmetric log scale: linear within +-1%) per scheme, one bar per model, with the
    95% intervals and the ``within`` line; ``changes``: ``{model: {scheme: Delta or None}}``, schemes ordered
    best first on the first model."""
    models = list(changes)
    first = changes[models[0]]
    schemes = sorted(first, key=lambda s: float("inf") if first[s] is None else first[s].value)
    fig, ax = plt.subplots(figsize=(8.0, 0.32 * len(schemes) + 1.6))
    height = 0.8 / len(models)
    cmap = plt.get_cmap("tab10")
    for j, model in enumerate(models):
        ds = [changes[model].get(s) for s in schemes]
        xs = [float("nan") if d is None else 100 * d.value for d in ds]
        err = [[0 if d is None or d.low is None else 100 * (d.value - d.low) for d in ds],
               [0 if d is None or d.high is None else 100 * (d.high - d.value) for d in ds]]
        ax.barh([i + j * height for i in range(len(schemes))], xs, height, xerr=err, label=model,
                color=cmap(j % 10), error_kw={"elinewidth": 0.8})
    ax.axvline(100 * within, color="k", linestyle="--", linewidth=0.8, label=f"+{within:.0%}")
    ax.set_yticks([i + (len(models) - 1) * height / 2 for i in range(len(schemes))], schemes, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set(xlabel="perplexity change, quantized vs float (%; log beyond +-1%)", title="which fix? (95% intervals)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, Path(path))
