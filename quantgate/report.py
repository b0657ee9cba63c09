"""Tables and plots across runs: ``compare`` sets evaluation results side by side, float against
quantized, with the change each scheme causes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

__all__ = ["compare", "collect_evals", "write_study_report", "study_markdown", "spearman", "pearson"]

HEADLINE = ("quantgate_ppl/word_perplexity", "quantgate_ppl/bits_per_byte", "quantgate_cloze/acc",
            "quantgate_nextsent/acc", "quantgate_mlm_ppl/perplexity")


def collect_evals(paths) -> list[dict]:
    """Every eval.json under the given files or directories, flattened to one record each."""
    records = []
    for p in map(Path, paths):
        if (p / "metrics.json").is_file():  # a study run: every cell, float and quantized
            records += _study_records(json.loads((p / "metrics.json").read_text()), p)
            continue
        files = [p] if p.is_file() else sorted(p.rglob("eval.json"))
        if not files:
            raise FileNotFoundError(f"{p} holds no eval.json or metrics.json (write one with quantgate eval ... "
                                    f"--out {p}, or run a study)")
        for f in files:
            data = json.loads(f.read_text())
            s = data["settings"]
            metrics = {f"{task}/{m}": v for task, ms in data["results"].items() for m, v in ms.items()
                       if m != "sample_len"}
            records.append({"model": s.get("model") or f.parent.name, "variant": s.get("variant"),
                            "scheme": s.get("quantization") or "float", "path": str(f), **metrics})
    return records


def _study_records(metrics: dict, path: Path) -> list[dict]:
    def flat(results):
        return {f"{task}/{m}": v for task, ms in (results or {}).items() for m, v in ms.items() if m != "sample_len"}

    out = []
    for c in metrics["cells"]:
        label = f"{metrics['study']['name']}:{c['model']}"
        out.append({"model": label, "variant": c["variant"], "scheme": "float", "path": str(path), **flat(c["float"])})
        out += [{"model": label, "variant": c["variant"], "scheme": s, "path": str(path), **flat(r.get("results"))}
                for s, r in c["schemes"].items()]
    return out


def compare(paths, out: str | Path | None = None) -> str:
    """Markdown table of every run, with each quantized run's change from the float run of the same
    model and variant; with ``out``, also compare.md, compare.csv and compare.png there."""
    records = collect_evals(paths)
    metrics = [m for m in HEADLINE if any(m in r for r in records)] or sorted(
        {k for r in records for k in r if "/" in k})
    base = {(r["model"], r["variant"]): r for r in records if r["scheme"] == "float"}
    rows = []
    for r in sorted(records, key=lambda r: (r["model"], str(r["variant"]), r["scheme"] != "float", r["scheme"])):
        ref = base.get((r["model"], r["variant"]))
        row = {"model": r["model"], "variant": r["variant"], "scheme": r["scheme"]}
        for m in metrics:
            row[m] = r.get(m)
            if ref is not None and r is not ref and r.get(m) is not None and ref.get(m) is not None:
                row[f"{m} delta"] = r[m] - ref[m]
        rows.append(row)
    columns = ["model", "variant", "scheme"] + [c for m in metrics for c in (m, f"{m} delta")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c), c.endswith("delta")) for c in columns) + " |")
    table = "\n".join(lines) + "\n"
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(table)
        with open(out / "compare.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            writer.writerows({c: row.get(c) for c in columns} for row in rows)
        _plot(rows, metrics, out / "compare.png")
    return table


def _plot(rows, metrics, path: Path) -> None:
    from .plots import bar_panels

    bar_panels({m: [(f"{r['model']}\n{r['variant']}\n{r['scheme']}", r.get(m)) for r in rows] for m in metrics}, path,
               title="float vs quantized")


# --- study reports --------------------------------------------------------------------------------

# the headline perplexity of a cell: the first of these its tasks report
PPL_KEYS = (("quantgate_ppl", "word_perplexity"), ("quantgate_mlm_ppl", "perplexity"),
            ("quantgate_backcopy", "perplexity"))
ACCURACY = (("quantgate_cloze", "acc"), ("quantgate_nextsent", "acc"), ("quantgate_backcopy", "copy_acc"))


def ppl_of(results: dict | None) -> float | None:
    """The headline perplexity in an evaluation's results (see PPL_KEYS), or None."""
    return next((v for v in (_get(results, k) for k in PPL_KEYS) if v is not None), None)


def _run(cell: dict) -> list[str]:
    """The seed and training tokens of a cell, for its table rows."""
    t = cell["trained"]
    return [str(cell["seed"]), f"{t['tokens']:,}" if t.get("trained") else "pretrained"]


def _get(results: dict | None, task_metric) -> float | None:
    task, metric = task_metric
    return ((results or {}).get(task) or {}).get(metric)


def _fmt(v, signed: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:+.4g}" if signed else f"{v:.4g}"
    return str(v)


def _rel(a, b) -> str:
    if a is None or b is None or not a:
        return "-"
    return f"{100 * (b - a) / a:+.1f}%"


def _ranks(values: list[float]) -> list[float]:
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
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sx = sum((a - mx) ** 2 for a in x) ** 0.5
    sy = sum((b - my) ** 2 for b in y) ** 0.5
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy)


def spearman(x: list[float], y: list[float]) -> float | None:
    return pearson(_ranks(x), _ranks(y))


def _quantities(cell: dict) -> dict:
    s = cell["observe"]["summary"]
    fp = ppl_of(cell["float"])
    out = {"gate mean": s.get("gate_mean"), "sink mass": s.get("sink_mass"), "max activation": s.get("max_activation"),
           "FP ppl": fp}
    for scheme, r in cell["schemes"].items():
        q = ppl_of(r.get("results"))
        out[f"ppl increase {scheme}"] = (q - fp) / fp if q is not None and fp else None
    return out


def _cost(cell: dict) -> list[str]:
    cost = cell.get("cost")  # absent in runs made before gate costs were recorded
    return [f"{cost['gate_params']:,}", _fmt(cost["gate_flops_per_token"])] if cost else ["-", "-"]


def study_markdown(metrics: dict) -> str:
    st, cells = metrics["study"], metrics["cells"]
    schemes = metrics["schemes"]
    m = metrics["machine"]
    lines = [f"# Study: {st['name']}", "", st.get("description", "").strip(), "",
             f"Reproduce: `{('quantgate study ' + st.get('file', '<study.yaml>')).strip()}`; rebuild this page from metrics.json with "
             f"`quantgate report <this directory>`.",
             f"Machine: {m['platform']}, {m['cpus']} CPUs ({m['torch_threads']} torch threads); "
             + ", ".join(f"{k} {v}" for k, v in metrics["versions"].items() if v) + ".",
             f"Compute: {metrics['wall_seconds']['steps_total']:.0f} s over all steps of all cells "
             f"({len(cells)} cells).", ""]
    lines += ["## What the numbers show", ""] + _sentences(cells, schemes) + [""]
    # Bondarenko-style table
    head = ["model", "variant", "seed", "tokens trained", "FP ppl", "max inf-norm", "kurtosis", "sink mass",
            "gate mean"]
    for s in schemes:
        head += [f"{s} ppl", "change"]
    lines += ["## Outliers, sinks and quantized perplexity (Bondarenko et al.'s table)", "",
              "Perplexity is `quantgate_ppl` word perplexity on held-out text for causal LMs, `quantgate_mlm_ppl` "
              "for masked LMs and `quantgate_backcopy` for models trained on the backcopy task; max inf-norm and "
              "kurtosis follow Bondarenko et al. (per sequence, averaged; max over layers / mean over layers); sink "
              "mass is the mean attention on the first token. All rows ran on the machine above.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        s = c["observe"]["summary"]
        fp = ppl_of(c["float"])
        row = [c["model"], c["variant"], *_run(c), _fmt(fp), _fmt(s["max_inf_norm"]), _fmt(s["kurtosis"]), _fmt(s["sink_mass"]),
               _fmt(s["gate_mean"])]
        for sch in schemes:
            r = c["schemes"].get(sch, {})
            q = ppl_of(r.get("results"))
            row += [_fmt(q) if "error" not in r else "n/a", _rel(fp, q)]
        lines.append("| " + " | ".join(row) + " |")
    acc_rows = [(c, t) for t in ACCURACY for c in cells if _get(c["float"], t) is not None]
    if acc_rows:
        head = ["model", "variant", "seed", "task", "FP acc"] + [f"{s} acc" for s in schemes]
        lines += ["", "## Accuracy (bundled tasks)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c, t in acc_rows:
            row = [c["model"], c["variant"], str(c["seed"]), t[0], _fmt(_get(c["float"], t))]
            row += [_fmt(_get(c["schemes"].get(s, {}).get("results"), t)) for s in schemes]
            lines.append("| " + " | ".join(row) + " |")
    # Qiu-style table and correlations
    head = ["model", "variant", "seed", "tokens trained", "mean gate", "max activation", "max / median",
            "first-token attention", "FP ppl", "gate params", "gate FLOPs / token"]
    lines += ["", "## Gate, activations and sinks (Qiu et al.'s table)", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for c in cells:
        s = c["observe"]["summary"]
        lines.append("| " + " | ".join([c["model"], c["variant"], *_run(c), _fmt(s["gate_mean"]), _fmt(s["max_activation"]),
                                        _fmt(s["max_median_ratio"]), _fmt(s["sink_mass"]),
                                        _fmt(ppl_of(c["float"])), *_cost(c)]) + " |")
    lines += ["", "Correlations across cells (Spearman / Pearson, n = cells with both numbers; none below 3):", ""]
    qs = [_quantities(c) for c in cells]
    names = list(qs[0]) if qs else []
    lines += ["| | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for a in names:
        row = [a]
        for b in names:
            pairs = [(q[a], q[b]) for q in qs if q.get(a) is not None and q.get(b) is not None]
            if a == b or len(pairs) < 3:
                row.append("-")
                continue
            x, y = [p[0] for p in pairs], [p[1] for p in pairs]
            row.append(f"{_fmt(spearman(x, y))} / {_fmt(pearson(x, y))} (n={len(pairs)})")
        lines.append("| " + " | ".join(row) + " |")
    lines += _side_by_side(cells, schemes)
    # quantization error
    lines += ["", "## Where quantization hurts", "", "| model | variant | scheme | logits SQNR (dB) | worst blocks (dB) | "
              "FP8 saturated values |", "|---|---|---|---|---|---|"]
    for c in cells:
        for sch, r in c["schemes"].items():
            if "error" in r:
                lines.append(f"| {c['model']} | {c['variant']} | {sch} | not run: {r['error']} | | |")
                continue
            worst = ", ".join(f"{w['layer']} ({w['sqnr_db']:.1f})" for w in r["worst_layers"])
            lines.append(f"| {c['model']} | {c['variant']} | {sch} | {_fmt(r['logits_sqnr_db'])} | {worst} | "
                         f"{r['overflow']} |")
    trained = [c for c in cells if c["trained"].get("trained")]
    if trained:
        lines += ["", "## Training", "", "| model | variant | seed | steps | tokens | final train loss | held-out loss |",
                  "|---|---|---|---|---|---|---|"]
        for c in trained:
            t = c["trained"]
            lines.append(f"| {c['model']} | {c['variant']} | {c['seed']} | {t['steps']} | {t['tokens']:,} | "
                         f"{_fmt(t['final_train_loss'])} | {_fmt(t['final_eval_loss'])} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in _plot_names(metrics)]
    notes = (st.get("report") or {}).get("notes", "").strip()
    if notes:
        lines += ["", "## Reading (from the study file)", "", notes]
    return "\n".join(lines).rstrip() + "\n"


def _side_by_side(cells: list[dict], schemes: list[str]) -> list[str]:
    """The variants that several models share, one row each, the models' numbers in adjacent columns."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    by = {(c["model"], c["variant"]): c for c in cells if c["seed"] == cells[0]["seed"]}
    shared = [v for v in dict.fromkeys(c["variant"] for c in cells) if sum((m, v) in by for m in models) > 1]
    if len(models) < 2 or not shared:
        return []
    scheme = schemes[0] if schemes else None
    metrics = [("FP ppl", lambda c: _fmt(ppl_of(c["float"]))),
               ("first-token attn", lambda c: _fmt(c["observe"]["summary"]["sink_mass"])),
               ("max activation", lambda c: _fmt(c["observe"]["summary"]["max_activation"])),
               *([(f"{scheme} change", lambda c: _rel(ppl_of(c["float"]), ppl_of(c["schemes"].get(scheme, {}).get("results"))))]
                 if scheme else []),
               ("gate params", lambda c: _cost(c)[0])]
    head = ["variant"] + [f"{m}: {name}" for name, _ in metrics for m in models]
    lines = ["", f"## Models side by side ({' vs '.join(models)})", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for v in shared:
        row = [v] + [fn(by[(m, v)]) if (m, v) in by else "-" for _, fn in metrics for m in models]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _sentences(cells: list[dict], schemes: list[str]) -> list[str]:
    out = []
    for c in cells:
        s = c["observe"]["summary"]
        ratio = s.get("max_median_ratio")
        massive = s.get("massive_activations", 0)
        where = ""
        if s.get("top_massive"):
            top = s["top_massive"][0]
            where = f" (largest: channel {top['channel']} in layer {top['layer']}, at token positions " \
                    f"{[p for p, _ in top['positions']]})"
        gate = f"; mean gate {_fmt(s['gate_mean'])}" if s.get("gate_mean") is not None else ""
        text = (f"- **{c['model']} / {c['variant']}**: largest residual activation {_fmt(s['max_activation'])} "
                f"({_fmt(ratio)} x the median), {massive} massive activations by Sun et al.'s criterion{where}; "
                f"mean first-token attention {_fmt(s['sink_mass'])}{gate}.")
        fp = ppl_of(c["float"])
        changes = []
        for sch in schemes:
            r = c["schemes"].get(sch, {})
            q = ppl_of(r.get("results"))
            if q is not None and fp is not None:
                changes.append(f"{sch} {_fmt(fp)} -> {_fmt(q)} ({_rel(fp, q)})")
        if changes:
            text += " Perplexity: " + "; ".join(changes) + "."
        out.append(text)
    return out


def _plot_names(metrics: dict) -> list[str]:
    names = ["study_layers.png", "study_quant.png"]
    if any(c["trained"].get("observe_curve") for c in metrics["cells"]):
        names.append("study_training.png")
    return names


def study_plots(metrics: dict, out: Path) -> None:
    from .plots import plot_study_layers, plot_study_quant, plot_study_training

    plot_study_layers(metrics["cells"], out / "study_layers.png")
    plot_study_quant(metrics["cells"], metrics["schemes"], ppl_of, out / "study_quant.png")
    if "study_training.png" in _plot_names(metrics):
        plot_study_training(metrics["cells"], out / "study_training.png")


def write_study_report(run_dir: str | Path) -> Path:
    """report.md and plots of a study run directory, from its metrics.json alone."""
    run_dir = Path(run_dir)
    f = run_dir / "metrics.json"
    if not f.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.json: run the study first (quantgate study ...)")
    metrics = json.loads(f.read_text())
    (run_dir / "report.md").write_text(study_markdown(metrics))
    study_plots(metrics, run_dir)
    return run_dir / "report.md"
