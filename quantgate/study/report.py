"""Tables and plots across runs: ``compare`` sets evaluation results side by side, float against
quantized, with the change each scheme causes and its 95% interval (:mod:`quantgate.stats`)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from pathlib import Path

from ..files import json_kind, read_json, writable_dir, write_text_atomic
from ..plots import bar_panels
from ..stats import MIN_BOOTSTRAP_UNITS, NOISE_LEGEND, change, fmt, format_delta, seed_delta, table_head
from .fixes import which_fix
from .measures import (
    ACCURACY,
    AFTER_FIRST,
    BUDGET,
    bit_sweeps,
    budget,
    change_gap,
    float_change,
    gap_reading,
    max_layer_sink,
    metric_of,
    peak_activation,
    ppl_change,
    ppl_of,
    scheme_change,
)
from .plots import plot_bit_sweeps, plot_fixes, plot_study_layers, plot_study_quant, plot_study_training
from .records import CellRecord, StudyRecord, read_metrics

__all__ = [
    "compare",
    "collect_evals",
    "write_study_report",
    "study_markdown",
    "study_plots",
    "spearman",
    "pearson",
]

HEADLINE = (
    "quantgate_ppl/word_perplexity",
    "quantgate_ppl/bits_per_byte",
    "quantgate_cloze/acc",
    "quantgate_nextsent/acc",
    "quantgate_mlm_ppl/perplexity",
)
MIN_CORRELATION_N = 5  # correlations across fewer cells are not printed
DELTA_LEGEND = (
    "Change (delta): quantized / float - 1 for perplexities, quantized - float for accuracies "
    "(percentage points) and bits per byte, with its 95% interval over the evaluated documents: a paired "
    f"bootstrap (1,000 resamples, BCa) from {MIN_BOOTSTRAP_UNITS} documents on, a jackknife t-interval (n - 1 "
    "degrees of freedom, on the log ratio for a perplexity) below. " + NOISE_LEGEND + "."
)
PAIRING_LEGEND = (
    "Reference: the run each change is measured against and how it was found: the float run of the same "
    "study cell; the float run whose weights' sha256 is the quantized run's recorded source (quantize() "
    "records it; quantgate eval records each model's sha256); or --baseline. Runs are never paired by "
    "name alone. a ± b: the value and lm-eval's stderr."
)


def collect_evals(paths: Iterable[str | Path]) -> list[dict]:
    """Every run under the given files or directories, flattened to one record each: quantgate's eval.json,
    lm-eval's own results JSON (``lm_eval --output_path``: ``results_<date>.json``, with its samples files
    where ``--log_samples`` wrote them) and study runs (metrics.json: every cell, float and quantized).

    A record holds ``model``, ``variant``, ``seed``, ``scheme`` (``float`` for a float run), ``quantized``,
    ``identity`` (the sha256 of the evaluated weights) and ``source`` (for a quantized run, the sha256 of
    its float source) where the run recorded them, ``cell`` (a study cell: its float and quantized runs
    pair), ``documents`` (per-document values), ``stderr`` (per metric, where the run has one), ``path``,
    ``kind`` (``eval``, ``lm-eval``, ``study``) and each ``task/metric``."""
    records: list[dict] = []
    seen: set[str] = set()
    for p in map(Path, paths):
        if (p / "metrics.json").is_file():  # a study run: every cell, float and quantized
            records += _study_records(read_metrics(p), p)
            continue
        files = [p] if p.is_file() else _run_files(p)
        if not files:
            raise FileNotFoundError(
                f"{p} holds no eval.json, lm-eval results JSON or metrics.json (write one with quantgate eval "
                f"... --out {p}, lm_eval --output_path {p}, or run a study)"
            )
        for f in files:
            if str(f.resolve()) not in seen:
                seen.add(str(f.resolve()))
                records.append(_file_record(f))
    return records


def _run_files(folder: Path) -> list[Path]:
    """The eval.json files under ``folder`` and the lm-eval results files that none of them wrote. A
    ``results_*.json`` that cannot be read is passed over (another tool's file, perhaps), unless nothing
    else is found: then its error, naming it, is raised."""
    evals = sorted(folder.rglob("eval.json"))
    written = set()
    for f in evals:
        out = _read_json(f).get("lm_eval_output") or {}
        if isinstance(out, dict) and isinstance(out.get("results"), str):
            written.add(str(Path(out["results"]).resolve()))
    lm, unreadable = [], []
    for f in sorted(folder.rglob("results_*.json")):  # lm_eval --output_path DIR
        try:
            if _lm_eval_shaped(_read_json(f)):
                lm.append(f)
        except ValueError as e:
            unreadable.append(e)
    found = evals + [f for f in lm if str(f.resolve()) not in written]
    if not found and unreadable:
        raise unreadable[0]
    return found


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``; a one-line ValueError naming it otherwise (:func:`quantgate.files.read_json`)."""
    return read_json(file, fix=REWRITE)


REWRITE = "write it again (quantgate eval ... --out, lm_eval --output_path) or leave it out of the runs compared"


def _lm_eval_shaped(data: dict) -> bool:
    lm_eval_keys = "configs" in data or "versions" in data
    return "settings" not in data and isinstance(data.get("results"), dict) and lm_eval_keys


def _file_record(f: Path) -> dict:
    data = _read_json(f)
    if "settings" in data and "results" in data:
        _check_fields(data, f, ("settings", "results", "documents"), "quantgate's eval.json")
        return _eval_record(data, f)
    if _lm_eval_shaped(data):
        _check_fields(data, f, ("config", "results"), "lm-eval's results JSON")
        return _lm_eval_record(data, f)
    raise ValueError(
        f"{f} is neither quantgate's eval.json (settings, results) nor lm-eval's results JSON (results, "
        f"configs, versions)"
    )


def _check_fields(data: dict, f: Path, fields: tuple[str, ...], kind: str) -> None:
    """A one-line ValueError naming ``f`` where one of ``fields`` (present and not null) is not a JSON object,
    or an entry of its results or documents (per task) is not one; what the records below read."""
    wrong = [k for k in fields if data.get(k) is not None and not isinstance(data[k], dict)]
    for k in ("results", "documents"):
        if not wrong and isinstance(data.get(k), dict):
            wrong = [f"{k}.{task}" for task, v in data[k].items() if not isinstance(v, dict)][:1]
    if wrong:
        value = data
        for part in wrong[0].split(".", 1):
            value = value[part]
        raise ValueError(
            f"cannot read {f}: its field {wrong[0]!r} is a JSON {json_kind(value)}, not an object, as {kind} "
            f"holds; {REWRITE}"
        )


def _eval_record(data: dict, f: Path) -> dict:
    s = data["settings"]
    quantized = bool(s.get("quantization"))
    return {
        "model": s.get("model") or f.parent.name,
        "variant": s.get("variant"),
        "seed": None,
        "scheme": s.get("quantization") or "float",
        "quantized": quantized,
        "identity": s.get("model_sha256"),
        "source": s.get("source_sha256") if quantized else None,
        "cell": None,
        "kind": "eval",
        "path": str(f),
        "settings": {"tasks": s.get("tasks"), "limit": s.get("limit")},
        "documents": data.get("documents") or {},
        "stderr": _stderr(data["results"]),
        **_flat(data["results"]),
    }


def _lm_eval_record(data: dict, f: Path) -> dict:
    """A record of lm-eval's results JSON: its model from ``config.model_args`` (``pretrained``), the
    quantization from those arguments or the checkpoint's config.json, per-document values from its
    samples files where they are beside it."""
    config = data.get("config") or {}
    args = _model_args(config.get("model_args"))
    name = args.get("pretrained") or args.get("model")
    label = str(name or data.get("model_name") or config.get("model") or f.parent.name)
    scheme, source = _lm_eval_quantization(args, name)
    results = {task: _lm_eval_metrics(ms) for task, ms in (data.get("results") or {}).items()}
    return {
        "model": label,
        "variant": None,
        "seed": None,
        "scheme": scheme,
        "quantized": scheme != "float",
        "identity": None,  # lm-eval records no hash of the weights
        "source": source,
        "cell": None,
        "kind": "lm-eval",
        "path": str(f),
        "settings": {"tasks": sorted(results), "limit": config.get("limit")},
        "documents": _lm_eval_documents(f, results),
        "stderr": _stderr(results),
        **_flat(results),
    }


def _model_args(args: object) -> dict:
    """lm-eval's ``model_args`` (``"pretrained=DIR,dtype=float32"`` or a dict) as a dict."""
    if isinstance(args, dict):
        return args
    out: dict = {}
    for item in filter(None, (a.strip() for a in str(args or "").split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def _lm_eval_quantization(args: dict, name: object) -> tuple[str, str | None]:
    """(scheme label or ``float``, source sha256 or None) of the model an lm-eval run loaded: its
    ``scheme`` argument, bitsandbytes / GPTQ arguments, else the checkpoint's own config.json (quantgate's
    record or another tool's quantization_config) and quantization.json sidecar, where it is a local folder."""
    from ..quant.imported import SIDECAR, describe, quantization_config

    source = None
    folder = Path(str(name)) if name else None
    if folder is not None and folder.is_dir():
        sidecar = folder / SIDECAR
        if sidecar.is_file():
            source = read_json(sidecar, fix=f"restore the {sidecar.name} saved with the model").get("source_sha256")
    if args.get("scheme"):
        return str(args["scheme"]), source
    truthy = {k for k, v in args.items() if str(v).lower() in ("true", "1")}
    if "load_in_8bit" in truthy:
        return describe({"quant_method": "bitsandbytes", "load_in_8bit": True})["scheme"], source
    if "load_in_4bit" in truthy:
        return describe({"quant_method": "bitsandbytes", "load_in_4bit": True})["scheme"], source
    if truthy & {"autogptq", "gptqmodel"}:
        return "gptq", source
    if folder is not None and (folder / "config.json").is_file():
        cfg = read_json(folder / "config.json", fix="restore the config.json saved with the model")
        own = (cfg.get("quantgate") or {}).get("quantization") or {}
        if own.get("scheme"):
            return str(own["scheme"]), source or own.get("source_sha256")
        qc = quantization_config(cfg)
        if qc is not None:
            return describe(qc)["scheme"], source
    return "float", source


def _lm_eval_metrics(metrics: dict) -> dict:
    """lm-eval's ``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}`` -> ``{"acc": 0.5, "acc_stderr": 0.1}``
    (the first filter of each metric; values that are not numbers, such as ``"N/A"``, dropped)."""
    out: dict = {}
    for key, value in metrics.items():
        name = key.split(",")[0]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and name not in out and not (isinstance(value, float) and math.isnan(value)):
            out[name] = float(value)
    return out


def _lm_eval_documents(f: Path, results: dict) -> dict:
    """Per-document values from the samples files lm-eval wrote beside ``f`` (``--log_samples``):
    ``samples_<task>_<date>.jsonl`` for ``results_<date>.json`` (or ``NAME_<date>.json``)."""
    from ..evaluate import sample_documents  # the same per-document columns as quantgate's eval.json

    date = f.stem.rsplit("_", 1)[-1]
    docs = {}
    for task in results:
        samples = f.with_name(f"samples_{task}_{date}.jsonl")
        if not samples.is_file():
            continue
        rows = _read_jsonl(samples)
        if rows and all(isinstance(r, dict) and "doc_id" in r and "filter" in r for r in rows):
            docs[task] = sample_documents(rows, {}, None)
    return docs


def _read_jsonl(file: Path) -> list:
    """The JSON value of each line of ``file`` (JSON Lines); a one-line ValueError naming the file and line."""
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"cannot read {file}: line {number} is not valid JSON (truncated?): {e}") from None
    return rows


def _flat(results: dict | None) -> dict:
    """``{task: {metric: value}}`` -> ``{"task/metric": value}``, without stderrs and sample lengths."""
    return {
        f"{task}/{m}": v
        for task, ms in (results or {}).items()
        for m, v in ms.items()
        if m != "sample_len" and not m.endswith("_stderr")
    }


def _stderr(results: dict | None) -> dict:
    """``{"task/metric": stderr}`` from the ``<metric>_stderr`` entries lm-eval reports."""
    return {
        f"{task}/{m.removesuffix('_stderr')}": v
        for task, ms in (results or {}).items()
        for m, v in ms.items()
        if m.endswith("_stderr") and isinstance(v, (int, float))
    }


def _study_records(metrics: StudyRecord, path: Path) -> list[dict]:
    out = []
    for c in metrics.cells:
        run = {
            "model": f"{metrics.study['name']}:{c.model}",
            "variant": c.variant,
            "seed": c.seed,
            "path": str(path),
            "identity": None,
            "source": None,
            "cell": f"{path}#{c.id}",  # its float and quantized runs are one model's, by construction
            "kind": "study",
            "settings": {},
            "stderr": {},
        }
        out.append(
            {**run, "scheme": "float", "quantized": False, "documents": c.float_documents, **_flat(c.float_results)}
        )
        out += [
            {**run, "scheme": s, "quantized": True, "documents": r.documents, **_flat(r.results)}
            for s, r in c.schemes.items()
        ]
    return out


def _references(records: list[dict], baseline: dict | None) -> list[tuple[dict | None, str]]:
    """Per record, the run its change is measured against and how they were paired: ``baseline`` where
    one is given; else a study cell's float run; else, for a quantized run, the float run whose identity
    (sha256 of its weights) is the quantized run's source hash. Never by name or label alone."""
    floats = [r for r in records if not r["quantized"]]
    out: list[tuple[dict | None, str]] = []
    for r in records:
        if baseline is not None:
            out.append((baseline, "--baseline") if r is not baseline else (None, "baseline"))
        elif r["cell"] is not None:
            ref = next((f for f in floats if f["cell"] == r["cell"]), None)
            out.append((ref, "study cell") if r["quantized"] and ref is not None else (None, ""))
        elif not r["quantized"]:
            out.append((None, ""))
        elif r["source"]:
            found = [f for f in floats if f["identity"] == r["source"]]
            same = [f for f in found if f["settings"] == r["settings"]]
            ref = next(iter(same or found), None)
            short = r["source"][:12]
            out.append((ref, f"source sha256 {short}") if ref else (None, f"none: no float run has sha256 {short}"))
        else:
            out.append((None, "none: no source hash recorded; pass --baseline"))
    return out


def compare(paths: Iterable[str | Path], out: str | Path | None = None, baseline: str | Path | None = None) -> str:
    """Markdown table of every run, with each quantized run's change from its float reference and the
    change's 95% interval (a paired bootstrap over the documents both runs kept; a point change marked
    ``[n/a]`` otherwise). The reference is, with ``baseline`` (a run directory or a results file), that
    run for every other; else a study cell's float run, or the float run whose weights' sha256 is the
    quantized run's recorded source (:func:`_references`). With ``out``, also compare.md, compare.csv (the
    change and its interval bounds as numbers) and compare.png there."""
    if out is not None:
        writable_dir(out)  # before reading the runs
    records = collect_evals(paths)
    base = None
    if baseline is not None:
        found = collect_evals([baseline])
        if len(found) != 1:
            raise ValueError(
                f"--baseline {baseline} holds {len(found)} runs; name one run (an eval.json, an lm-eval results "
                f"file, or a directory holding just one)"
            )
        base = found[0]
        key = (base["path"], base["cell"], base["scheme"])
        records = [base] + [r for r in records if (r["path"], r["cell"], r["scheme"]) != key]
    metrics = [m for m in HEADLINE if any(m in r for r in records)] or sorted(
        {k for r in records for k in r if "/" in k}
    )
    records.sort(
        key=lambda r: (
            r is not base,
            r["model"],
            str(r["variant"]),
            r["seed"] or 0,
            r["quantized"],
            r["scheme"],
        )
    )
    rows, notes = [], []
    for r, (ref, how) in zip(records, _references(records, base), strict=True):
        row = {"model": r["model"], "variant": r["variant"], "seed": r["seed"], "scheme": r["scheme"]}
        row["reference"] = f"{ref['model']} {ref['scheme']} ({how})" if ref is not None else how or None
        for m in metrics:
            row[m], row[f"{m} stderr"] = r.get(m), r["stderr"].get(m)
            if ref is None:
                continue
            task, metric = m.split("/", 1)
            try:
                d = change(metric, ref.get(m), r.get(m), ref["documents"].get(task), r["documents"].get(task))
            except ValueError as e:  # the two runs read different documents: no change between them
                notes.append(f"{r['model']} {r['scheme']} vs {ref['model']} {ref['scheme']}, {m}: {e}")
                d = None
            row[f"{m} delta"] = d
            if d is not None and d.low is None and d.n == 0:
                notes.append(
                    f"{r['model']} {r['scheme']}, {m}: point change [n/a], no interval: "
                    + ("neither run" if not (ref["documents"].get(task) or r["documents"].get(task)) else "one run")
                    + " kept per-document values"
                )
        rows.append(row)
    columns = ["model", "variant", "seed", "scheme", "reference"] + [c for m in metrics for c in (m, f"{m} delta")]
    lines = table_head(columns)
    for row in rows:
        cells = []
        for c in columns:
            if c.endswith("delta"):
                cells.append(format_delta(row.get(c)))
            elif row.get(f"{c} stderr") is not None:
                cells.append(f"{fmt(row.get(c))} ± {fmt(row[f'{c} stderr'])}")
            else:
                cells.append(fmt(row.get(c)))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n\n" + DELTA_LEGEND + " " + PAIRING_LEGEND + "\n"
    if notes:
        table += "\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes)) + "\n"
    if out is not None:
        out = Path(out)
        write_text_atomic(out / "compare.md", table)
        _write_csv(rows, metrics, out / "compare.csv")
        _plot(rows, metrics, out / "compare.png")
    return table


def _write_csv(rows: list[dict], metrics: list[str], path: Path) -> None:
    """One row per run; each delta as three numbers: the change, and its interval's low and high ends
    (empty for a point change); a metric's stderr where the run reported one."""
    run = ["model", "variant", "seed", "scheme", "reference"]
    columns = run + [c for m in metrics for c in (m, f"{m} stderr", f"{m} delta", f"{m} delta low", f"{m} delta high")]
    fh = io.StringIO(newline="")
    writer = csv.DictWriter(fh, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        flat = {c: row.get(c) for c in (*run, *metrics, *(f"{m} stderr" for m in metrics))}
        for m in metrics:
            d = row.get(f"{m} delta")
            if d is not None:
                flat |= {f"{m} delta": d.value, f"{m} delta low": d.low, f"{m} delta high": d.high}
        writer.writerow(flat)
    write_text_atomic(path, fh.getvalue())


def _plot(rows, metrics, path: Path) -> None:
    def label(r):
        # short: a path's last part, a scheme's name without its details in parentheses
        parts = [Path(str(r["model"])).name or str(r["model"]), r["variant"], r["seed"], r["scheme"].split(" (")[0]]
        return "\n".join(str(p) for p in parts if p is not None)

    bar_panels({m: [(label(r), r.get(m)) for r in rows] for m in metrics}, path, title="float vs quantized")


# --- study reports --------------------------------------------------------------------------------

OUTLIER_LEGEND = (
    "Max inf-norm: per tensor, each sequence's max |x| averaged over sequences (Bondarenko et al.), the largest "
    "over their tensors. Max activation: the largest |x| of the residual stream (block outputs) over blocks; "
    "max / median: that block's max |x| over its median |x|, so that a smaller maximum at the same ratio reads as a "
    "smaller scale, not fewer outliers. Kurtosis: mu4 / sigma^4 (non-excess, Gaussian = 3) of each sequence's "
    "flattened tokens x channels tensor, averaged over sequences, then over Bondarenko et al.'s tensors (their "
    "reference code): for BERT each layer's FFN output and the LayerNorm output after it (the inf-norm adds that "
    "LayerNorm's input, the residual sum); for decoders each block's output, attention output, FFN output and the "
    "outputs of its two norms, and the final norm's output."
)


def _run(cell: CellRecord) -> list[str]:
    """The seed and training tokens of a cell, for its table rows."""
    return [str(cell.seed), f"{cell.trained['tokens']:,}" if cell.is_trained else "pretrained"]


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
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / (sx * sy)


def spearman(x: list[float], y: list[float]) -> float | None:
    return pearson(_ranks(x), _ranks(y))


def _quantities(cell: CellRecord, schemes: list[str], changes: dict) -> dict:
    s = cell.summary
    peak, ratio = peak_activation(cell)
    out = {
        "gate mean": s.get("gate_mean"),
        "sink mass": s.get("sink_mass"),
        "max activation": peak,
        "max / median": ratio,
        "FP ppl": ppl_of(cell.float_results),
    }
    for scheme in schemes:
        d = changes[cell.id, scheme]
        out[f"ppl increase {scheme}"] = d.value if d is not None else None
    return out


def _cost(cell: CellRecord) -> list[str]:
    cost = cell.cost  # None in runs made before gate costs were recorded
    return [f"{cost['gate_params']:,}", fmt(cost["gate_flops_per_token"])] if cost else ["-", "-"]


def study_markdown(metrics: StudyRecord) -> str:
    st, cells = metrics.study, metrics.cells
    schemes = metrics.schemes
    changes = {(c.id, s): ppl_change(c, s) for c in cells for s in schemes}
    m = metrics.machine
    lines = [
        f"# Study: {st['name']}",
        "",
        st.get("description", "").strip(),
        "",
        f"Reproduce: `{('quantgate study ' + st.get('file', '<study.yaml>')).strip()}`; "
        "rebuild this page from metrics.json with `quantgate report <this directory>`.",
        f"Machine: {m['platform']}, {m['cpus']} CPUs ({m['torch_threads']} torch threads); "
        + ", ".join(f"{k} {v}" for k, v in metrics.versions.items() if v)
        + ".",
        f"Compute: {metrics.wall_seconds['steps_total']:.0f} s over all steps of all cells ({len(cells)} cells).",
        "",
    ]
    settings = metrics.report
    criterion = (settings.get("criterion") or "").strip()
    if criterion:  # declared in the study file before its runs (its git history shows when)
        lines += ["## Success criterion (from the study file, declared before the runs)", "", criterion, ""]
    fixes = settings.get("fixes")
    if fixes:
        lines += which_fix(cells, schemes, changes, fixes, settings.get("pairs") or [])
    own = {m["name"]: [e["scheme"] for e in m.get("schemes") or []] for m in st.get("models") or []}
    lines += _answer(cells, schemes, changes, settings.get("pairs") or [], own)
    lines += ["## What the numbers show", "", *_sentences(cells, schemes, changes), ""]
    # Bondarenko-style table
    head = [
        "model",
        "variant",
        "seed",
        "tokens trained",
        "FP ppl",
        "max inf-norm",
        "max activation",
        "max / median",
        "kurtosis",
        "sink mass",
        "gate mean",
    ]
    for s in schemes:
        head += [f"{s} ppl", "change [95% CI]"]
    lines += [
        "## Outliers, sinks and quantized perplexity (Bondarenko et al.'s table)",
        "",
        "Perplexity is `quantgate_ppl` word perplexity on held-out text for causal LMs, `quantgate_mlm_ppl` "
        "for masked LMs and `quantgate_backcopy` for models trained on the backcopy task; sink mass is the mean "
        "attention on the first token. All rows ran on the machine above.",
        "",
        OUTLIER_LEGEND,
        "",
        DELTA_LEGEND,
        "",
        *table_head(head),
    ]
    for c in cells:
        summ = c.summary
        row = [
            c.model,
            c.variant,
            *_run(c),
            fmt(ppl_of(c.float_results)),
            fmt(summ["max_inf_norm"]),
            *map(fmt, peak_activation(c)),
            fmt(summ["kurtosis"]),
            fmt(summ["sink_mass"]),
            fmt(summ["gate_mean"]),
        ]
        for sch in schemes:
            r = c.scheme(sch)
            row += [fmt(ppl_of(r.results)) if r.error is None else "n/a", format_delta(changes[c.id, sch])]
        lines.append("| " + " | ".join(row) + " |")
    lines += _across_seeds(cells, schemes, changes)
    lines += _bit_budget(cells, schemes, changes)
    acc_rows = [(c, t) for t in ACCURACY for c in cells if metric_of(c.float_results, t) is not None]
    if acc_rows:
        head = ["model", "variant", "seed", "task", "FP acc"] + [x for s in schemes for x in (f"{s} acc", "change")]
        lines += [
            "",
            "## Accuracy (bundled tasks)",
            "",
            "Change in percentage points, with its 95% paired interval over the items (as above); "
            + NOISE_LEGEND
            + ".",
            "",
            *table_head(head),
        ]
        for c, t in acc_rows:
            row = [c.model, c.variant, str(c.seed), t[0], fmt(metric_of(c.float_results, t))]
            for s in schemes:
                row += [fmt(metric_of(c.scheme(s).results, t)), format_delta(scheme_change(c, s, t))]
            lines.append("| " + " | ".join(row) + " |")
    # Qiu-style table and correlations
    head = [
        "model",
        "variant",
        "seed",
        "tokens trained",
        "mean gate",
        "max activation",
        "max / median",
        "first-token attention",
        "FP ppl",
        "gate params",
        "gate FLOPs / token",
    ]
    lines += [
        "",
        "## Gate, activations and sinks (Qiu et al.'s table)",
        "",
        *table_head(head),
    ]
    for c in cells:
        summ = c.summary
        lines.append(
            "| "
            + " | ".join(
                [
                    c.model,
                    c.variant,
                    *_run(c),
                    fmt(summ["gate_mean"]),
                    *map(fmt, peak_activation(c)),
                    fmt(summ["sink_mass"]),
                    fmt(ppl_of(c.float_results)),
                    *_cost(c),
                ]
            )
            + " |"
        )
    lines += _correlations([_quantities(c, schemes, changes) for c in cells])
    lines += _against_baseline(cells, schemes, changes, settings.get("baseline"))
    lines += _side_by_side(cells, schemes, changes)
    # quantization error
    lines += [
        "",
        "## Where quantization hurts",
        "",
        "| model | variant | scheme | logits SQNR (dB) | worst blocks (dB) | FP8 saturated values |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        for sch, r in c.schemes.items():
            if r.error is not None:
                lines.append(f"| {c.model} | {c.variant} | {sch} | not run: {r.error} | | |")
                continue
            worst = ", ".join(f"{w['layer']} ({w['sqnr_db']:.1f})" for w in r.worst_layers)
            lines.append(f"| {c.model} | {c.variant} | {sch} | {fmt(r.logits_sqnr_db)} | {worst} | {r.overflow} |")
    trained = [c for c in cells if c.is_trained]
    if trained:
        lines += [
            "",
            "## Training",
            "",
            "| model | variant | seed | steps | tokens | final train loss | held-out loss |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in trained:
            tr = c.trained
            lines.append(
                f"| {c.model} | {c.variant} | {c.seed} | {tr['steps']} | {tr['tokens']:,} | "
                f"{fmt(tr['final_train_loss'])} | {fmt(tr['final_eval_loss'])} |"
            )
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in _plot_names(metrics)]
    notes = settings.get("notes", "").strip()
    if notes:
        lines += ["", "## Reading (from the study file)", "", notes]
    return "\n".join(lines).rstrip() + "\n"


def _bit_budget(cells: list[CellRecord], schemes: list[str], changes: dict) -> list[str]:
    sweeps = bit_sweeps(schemes)
    if not sweeps:
        return []
    lines = [
        "## Bit budget",
        "",
        f"The fewest activation bits at which the perplexity increase stays under {BUDGET:.0%} (at that width "
        f"and every wider one), with the increase and its interval there; the sweep's changes beside it. A "
        f"budget whose interval reaches past {BUDGET:.0%} is not resolved by this evaluation. Plot: "
        f"study_bits.png.",
        "",
    ]
    for base, points in sweeps.items():
        head = ["model", "variant", "seed", "budget", *[f"A{b}" for b, _ in points]]
        lines += [f"`{base}`:", "", *table_head(head)]
        for c in cells:
            deltas = [(b, changes.get((c.id, sch))) for b, sch in points]
            found = budget(deltas)
            text = f"A{found[0]}: {format_delta(found[1])}" if found else f"none (A{points[0][0]} already over)"
            lines.append(
                "| "
                + " | ".join([c.model, c.variant, *_run(c)[:1], text, *[format_delta(d) for _, d in deltas]])
                + " |"
            )
        lines.append("")
    return lines


def _across_seeds(cells: list[CellRecord], schemes: list[str], changes: dict) -> list[str]:
    """Per model and variant trained with several seeds: the perplexity change averaged over the seeds
    (:func:`stats.seed_delta`: geometric mean of the ratios), with a t-interval across them."""
    by: dict[tuple[str, str], list[CellRecord]] = {}
    for c in cells:
        by.setdefault((c.model, c.variant), []).append(c)
    groups = {k: g for k, g in by.items() if len(g) > 1}
    if not groups:
        return []
    head = ["model", "variant", "seeds", "FP ppl (mean)"] + [
        f"{s} change, geometric mean [95% t-interval]" for s in schemes
    ]
    lines = [
        "",
        "## Across seeds",
        "",
        "Each seed's perplexity ratio from the table above, averaged geometrically "
        "over the seeds, with a 95% Student t-interval on the log ratios across the seeds (seed-to-seed "
        "spread; the per-seed intervals are over documents). " + NOISE_LEGEND + ".",
        "",
        *table_head(head),
    ]
    for (model, variant), group in groups.items():
        fp = [v for c in group if (v := ppl_of(c.float_results)) is not None]
        row = [model, variant, ", ".join(str(c.seed) for c in group), fmt(sum(fp) / len(fp) if fp else None)]
        for s in schemes:
            deltas = [changes[c.id, s] for c in group if changes[c.id, s] is not None]
            row.append(format_delta(seed_delta([d.value for d in deltas], deltas[0].kind)) if deltas else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _correlations(qs: list[dict]) -> list[str]:
    """Spearman / Pearson between every two quantities across cells, where at least MIN_CORRELATION_N
    cells have both."""
    lines = [
        "",
        f"Correlations across cells (Spearman / Pearson; n = cells with both numbers; omitted below "
        f"n = {MIN_CORRELATION_N}):",
        "",
    ]
    names = list(qs[0]) if qs else []
    rows = []
    for a in names:
        row = [a]
        for b in names:
            pairs = [(q[a], q[b]) for q in qs if q.get(a) is not None and q.get(b) is not None]
            if a == b or len(pairs) < MIN_CORRELATION_N:
                row.append("-")
                continue
            x, y = [p[0] for p in pairs], [p[1] for p in pairs]
            row.append(f"{fmt(spearman(x, y))} / {fmt(pearson(x, y))} (n={len(pairs)})")
        rows.append(row)
    if all(v == "-" for row in rows for v in row[1:]):
        return [*lines, f"None: fewer than {MIN_CORRELATION_N} cells have any two of the numbers."]
    return (
        lines
        + ["| | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        + ["| " + " | ".join(row) + " |" for row in rows]
    )


def _against_baseline(cells: list[CellRecord], schemes: list[str], changes: dict, baseline: str | None) -> list[str]:
    """Each variant against the ``baseline`` variant of its model and seed (``report: baseline``): float
    perplexity relative to the baseline's, paired over the held-out documents both read; gate parameters
    as a share of the baseline's; first-token attention; the bit sweeps' perplexity changes."""
    if not baseline:
        return []
    base = {(c.model, c.seed): c for c in cells if c.variant == baseline}
    if not base:  # e.g. a smoke run, which keeps each model's first variant
        return []
    swept = [(b, s) for points in bit_sweeps(schemes).values() for b, s in points]
    head = [
        "model",
        "variant",
        "seed",
        f"FP ppl vs {baseline}",
        f"gate params (x {baseline}'s)",
        "first-token attention (max layer)",
        *(f"{s}" for _, s in swept),
    ]
    lines = [
        "",
        f"## Against {baseline}",
        "",
        f"Float perplexity of each variant relative to `{baseline}` of the same model and seed, with its 95% "
        "paired interval over the held-out documents both read; gate parameters, and their multiple "
        f"of `{baseline}`'s where it has any; the quantized changes are each model's own (float to quantized). "
        + NOISE_LEGEND
        + ".",
        "",
        *table_head(head),
    ]
    for c in cells:
        b = base.get((c.model, c.seed))
        if b is None:
            continue
        params = (c.cost or {}).get("gate_params"), (b.cost or {}).get("gate_params")
        sink, layer = max_layer_sink(c)
        lines.append(
            "| "
            + " | ".join(
                [
                    c.model,
                    c.variant,
                    str(c.seed),
                    "-" if c is b else format_delta(float_change(b, c)),
                    "-"
                    if params[0] is None
                    else f"{params[0]:,}" + (f" ({params[0] / params[1]:.2f}x)" if params[1] else ""),
                    f"{sink:.2f} ({layer})",
                    *(format_delta(changes.get((c.id, s))) for _, s in swept),
                ]
            )
            + " |"
        )
    gaps = [(b, c) for c in cells if (b := base.get((c.model, c.seed))) is not None and c is not b]
    if gaps and schemes:
        lines += [
            "",
            f"Paired against `{baseline}`: each scheme's change of the variant minus that of `{baseline}`, "
            "both read on the same documents, with its paired 95% interval over them (the decision: "
            f"negative and clear of 0, the variant loses less). {RATIO_NOTE}",
            "",
            *table_head(
                [
                    "model",
                    "variant",
                    "seed",
                    "scheme",
                    f"{baseline} change",
                    "variant change",
                    "paired difference",
                    "reading",
                ]
            ),
        ]
        for b, c in gaps:
            for s in schemes:
                gap = change_gap(b, c, s)
                own = [format_delta(changes.get((x.id, s))) for x in (b, c)]
                lines.append(
                    f"| {c.model} | {c.variant} | {c.seed} | {s} | {own[0]} | {own[1]} | {format_delta(gap)} | "
                    f"{gap_reading(gap, 'the variant')} |"
                )
    return lines


def _side_by_side(cells: list[CellRecord], schemes: list[str], changes: dict) -> list[str]:
    """The variants that several models share, one row each, the models' numbers in adjacent columns."""
    models = list(dict.fromkeys(c.model for c in cells))
    by = {(c.model, c.variant): c for c in cells if c.seed == cells[0].seed}
    shared = [v for v in dict.fromkeys(c.variant for c in cells) if sum((m, v) in by for m in models) > 1]
    if len(models) < 2 or not shared:
        return []
    scheme = schemes[0] if schemes else None

    def peak(c):
        top, ratio = peak_activation(c)
        return f"{fmt(top)} ({fmt(ratio)})"

    metrics = [
        ("FP ppl", lambda c: fmt(ppl_of(c.float_results))),
        ("first-token attn", lambda c: fmt(c.summary["sink_mass"])),
        ("max activation (max / median)", peak),
        *([(f"{scheme} change", lambda c: format_delta(changes[c.id, scheme]))] if scheme else []),
        ("gate params", lambda c: _cost(c)[0]),
    ]
    head = ["variant"] + [f"{m}: {name}" for name, _ in metrics for m in models]
    lines = [
        "",
        f"## Models side by side ({' vs '.join(models)})",
        "",
        *table_head(head),
    ]
    for v in shared:
        row = [v] + [fn(by[(m, v)]) if (m, v) in by else "-" for _, fn in metrics for m in models]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _answer(
    cells: list[CellRecord], schemes: list[str], changes: dict, pairs: list[list[str]], own: dict[str, list[str]]
) -> list[str]:
    """The study's answer first: per [ungated, gated] pair of models (``report: pairs``), the first scheme the
    pair ran (in the ungated model's own order, ``own``: {model: its schemes}) with its paired difference, the
    activation-bit budgets and a table of every scheme paired; then each other model's changes."""
    if not pairs:
        return []
    first: dict[str, CellRecord] = {}
    for c in cells:
        first.setdefault(c.model, c)
    lines = ["## The answer", ""]
    for ungated, gated in pairs:
        u, g = first[ungated], first[gated]
        scheme = next(
            (s for s in own.get(ungated) or schemes if changes.get((u.id, s)) and changes.get((g.id, s))), None
        )
        if scheme is None:  # no scheme evaluated on both
            continue
        du, dg = changes[u.id, scheme], changes[g.id, scheme]
        gap = change_gap(u, g, scheme)

        def about(c):
            (sink, layer), (_, ratio) = max_layer_sink(c), peak_activation(c)
            return f"first-token attention up to {sink:.2f} (layer {layer}), max / median {fmt(ratio)}"

        text = (
            f"- **{ungated}** (ungated; {about(u)}) changes by {format_delta(du)} under `{scheme}`, its gated "
            f"twin **{gated}** ({about(g)}) by {format_delta(dg)}; paired over the same documents, the gated "
            f"twin's change minus the ungated one's is {format_delta(gap)}: {gap_reading(gap, 'the gated twin')}."
        )
        first_prediction = change_gap(u, g, scheme, AFTER_FIRST)
        if first_prediction is not None:
            text += (
                " Without the first prediction (the random token after BOS) the paired difference is "
                f"{format_delta(first_prediction)}."
            )
        for base, points in bit_sweeps(schemes).items():
            budgets = [budget([(b, changes.get((c.id, s))) for b, s in points]) for c in (u, g)]
            text += (
                f" Activation-bit budget (`{base}`, +{BUDGET:.0%}): "
                + " vs ".join(f"A{f[0]}" if f else "none" for f in budgets)
                + "; "
                + "; ".join(
                    f"A{b}: {format_delta(changes.get((u.id, s)))} vs {format_delta(changes.get((g.id, s)))} "
                    f"(paired difference {format_delta(change_gap(u, g, s))})"
                    for b, s in points[1:]
                )
                + "."
            )
            for task_metric in (t for t in ACCURACY if metric_of(u.float_results, t) is not None):
                text += (
                    f" {task_metric[1]} ({task_metric[0]}): "
                    + "; ".join(
                        f"A{b} {format_delta(scheme_change(u, s, task_metric))} vs "
                        f"{format_delta(scheme_change(g, s, task_metric))}"
                        for b, s in points
                    )
                    + "."
                )
        lines.append(text)
    for ungated, gated in pairs:
        lines += _pair_table(first[ungated], first[gated], schemes, changes)
    paired = {m for p in pairs for m in p}
    for model, c in first.items():
        if model not in paired:
            moved = [f"{format_delta(changes[c.id, s])} under `{s}`" for s in schemes if changes.get((c.id, s))]
            peak, ratio = peak_activation(c)
            lines.append(
                f"- **{model}** ({c.variant}; largest residual activation {fmt(peak)}, max / median "
                f"{fmt(ratio)}): " + "; ".join(moved) + "."
            )
    return [*lines, ""]


RATIO_NOTE = (
    "Where either perplexity grew 10x or more the difference is the ratio of the two perplexity ratios instead "
    "(printed 0.02x: the variant's ratio is a fiftieth of the other's; below 1x it loses less)."
)


def _pair_table(u: CellRecord, g: CellRecord, schemes: list[str], changes: dict) -> list[str]:
    """Every scheme both twins ran, side by side: each one's change, the paired difference of the changes (the
    decision) and, on backcopy, the same without the first prediction."""
    both = [s for s in schemes if changes.get((u.id, s)) and changes.get((g.id, s))]
    after = any(change_gap(u, g, s, AFTER_FIRST) is not None for s in both)
    head = ["scheme", f"{u.model} change", f"{g.model} change", "paired difference", "reading"]
    if after:
        head.insert(4, "paired, without the first prediction")
    lines = [
        "",
        f"Every scheme on **{u.model}** and **{g.model}**, the gated twin's change minus the ungated one's paired "
        f"over the same documents. {RATIO_NOTE}",
        "",
        *table_head(head),
    ]
    for s in both:
        gap = change_gap(u, g, s)
        row = [f"`{s}`", format_delta(changes[u.id, s]), format_delta(changes[g.id, s]), format_delta(gap)]
        if after:
            row.append(format_delta(change_gap(u, g, s, AFTER_FIRST)))
        lines.append("| " + " | ".join([*row, gap_reading(gap, "the gated twin")]) + " |")
    return [*lines, ""]


def _sentences(cells: list[CellRecord], schemes: list[str], changes: dict) -> list[str]:
    out = []
    for c in cells:
        s = c.summary
        peak, ratio = peak_activation(c)
        massive = s.get("massive_activations", 0)
        where = ""
        if s.get("top_massive"):
            top = s["top_massive"][0]
            where = (
                f" (largest: channel {top['channel']} in layer {top['layer']}, at token positions "
                f"{[p for p, _ in top['positions']]})"
            )
        gate = f"; mean gate {fmt(s['gate_mean'])}" if s.get("gate_mean") is not None else ""
        text = (
            f"- **{c.model} / {c.variant}**: largest residual activation {fmt(peak)} "
            f"({fmt(ratio)} x its block's median), {massive} massive activations by Sun et al.'s criterion"
            f"{where}; mean first-token attention {fmt(s['sink_mass'])}{gate}."
        )
        fp = ppl_of(c.float_results)
        moves = []
        for sch in schemes:
            q = ppl_of(c.scheme(sch).results)
            if q is not None and fp is not None:
                moves.append(f"{sch} {fmt(fp)} -> {fmt(q)} ({format_delta(changes[c.id, sch])})")
        if moves:
            text += " Perplexity: " + "; ".join(moves) + "."
        out.append(text)
    return out


def _plot_names(metrics: StudyRecord) -> list[str]:
    names = ["study_layers.png", "study_quant.png"]
    if bit_sweeps(metrics.schemes):
        names.append("study_bits.png")
    if any(c.trained.get("observe_curve") for c in metrics.cells):
        names.append("study_training.png")
    if metrics.report.get("fixes"):
        names.append("study_fixes.png")
    return names


def study_plots(metrics: StudyRecord, out: Path) -> None:
    plot_study_layers(metrics.cells, out / "study_layers.png")
    plot_study_quant(metrics.cells, metrics.schemes, out / "study_quant.png")
    if "study_bits.png" in _plot_names(metrics):
        sweeps = {
            base: [(b, {c.id: ppl_change(c, sch) for c in metrics.cells}) for b, sch in points]
            for base, points in bit_sweeps(metrics.schemes).items()
        }
        plot_bit_sweeps(sweeps, [c.id for c in metrics.cells], BUDGET, out / "study_bits.png")
    if "study_training.png" in _plot_names(metrics):
        plot_study_training(metrics.cells, out / "study_training.png")
    if "study_fixes.png" in _plot_names(metrics):
        fixes = metrics.report["fixes"]
        plot_fixes(
            {c.model: {s: ppl_change(c, s) for s in metrics.schemes} for c in metrics.cells},
            float(fixes.get("within", 0.01)),
            out / "study_fixes.png",
        )


def write_study_report(run_dir: str | Path) -> Path:
    """report.md and plots of a study run directory, from its metrics.json alone."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    write_text_atomic(run_dir / "report.md", study_markdown(metrics))
    study_plots(metrics, run_dir)
    return run_dir / "report.md"
