"""Tables and plots across runs: ``compare`` sets evaluation results side by side, float against
quantized, with the change each scheme causes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

__all__ = ["compare", "collect_evals"]

HEADLINE = ("quantgate_ppl/word_perplexity", "quantgate_ppl/bits_per_byte", "quantgate_cloze/acc",
            "quantgate_nextsent/acc", "quantgate_mlm_ppl/perplexity")


def collect_evals(paths) -> list[dict]:
    """Every eval.json under the given files or directories, flattened to one record each."""
    records = []
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(p.rglob("eval.json"))
        if not files:
            raise FileNotFoundError(f"{p} holds no eval.json (write one with quantgate eval ... --out {p})")
        for f in files:
            data = json.loads(f.read_text())
            s = data["settings"]
            metrics = {f"{task}/{m}": v for task, ms in data["results"].items() for m, v in ms.items()
                       if m != "sample_len"}
            records.append({"model": s.get("model") or f.parent.name, "variant": s.get("variant"),
                            "scheme": s.get("quantization") or "float", "path": str(f), **metrics})
    return records


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
        lines.append("| " + " | ".join(_cell(row.get(c), c.endswith("delta")) for c in columns) + " |")
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


def _cell(v, delta: bool) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.4g}" if delta else f"{v:.4g}"
    return str(v)


def _plot(rows, metrics, path: Path) -> None:
    from .plots import bar_panels

    bar_panels({m: [(f"{r['model']}\n{r['variant']}\n{r['scheme']}", r.get(m)) for r in rows] for m in metrics}, path,
               title="float vs quantized")
