"""``quantgate compare``: evaluation results side by side, float against quantized, with the change each scheme
causes and its 95% interval (:mod:`quantgate.stats`). Reads quantgate's eval.json, lm-eval's results JSON and
study runs (:func:`collect_evals`); pairs each quantized run with its float reference by weights' hash or study
cell, never by name (:func:`_references`). Every number read is checked as a study's metrics.json's are
(:func:`~.records.wrong_evaluation`: finite, in range, each headline agreeing with its per-document values); a
file that fails is refused in one line naming it and the field."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, MissingFile
from ..eval.evaluate import Evaluation, EvaluationSettings, sample_documents
from ..eval.tasks import TASKS, bundled, computed
from ..files import claim_output, json_kind, read_json, read_json_lines, write_text_atomic
from ..json_record import RecordError
from ..models.record import checked_record
from ..plots import bar_panels
from ..stats import DELTA_LEGEND, Delta, change, fmt, format_delta, table_head, table_row
from .records import StudyRecord, read_metrics, wrong_evaluation

__all__ = ["compare", "collect_evals", "Run"]

PAIRING_LEGEND = (
    "Reference: the run each change is measured against and how it was found: the float run of the same "
    "study cell; the float run whose weights' sha256 is the quantized run's recorded source (quantize() "
    "records it; quantgate eval records each model's sha256); or --baseline (refused where a quantized run "
    "records another source, unless --force-baseline). Runs are never paired by name alone, nor across lm-eval "
    "settings that change the numbers (few-shot, task version, limit, ...). a ± b: the value and lm-eval's stderr."
)


@dataclass(frozen=True, eq=False)
class Run:
    """One evaluation run as compare reads it, from any of the files it takes (:func:`collect_evals`): the
    ``model``, ``variant`` and ``seed`` it names, its ``scheme`` (``float`` for a float run); ``identity`` (the
    sha256 of the evaluated weights) and ``source`` (for a quantized run, the sha256 of its float source) where
    the run recorded them; ``cell`` (a study cell: its float and quantized runs pair); the ``path`` read and its
    ``kind`` (``eval``, ``lm-eval``, ``study``); the ``tasks`` and ``limit`` it ran with, its ``protocol`` (the
    settings that change the numbers, :data:`PROTOCOL`: lm-eval's values, as recorded); each metric's ``values``
    and, where the run reported one, ``stderr`` (both under ``task/metric``), and per task its ``documents``
    (per-document columns, :mod:`quantgate.stats`)."""

    model: str
    variant: str | None
    seed: int | None
    scheme: str
    identity: str | None
    source: str | None
    cell: str | None
    kind: str
    path: str
    values: dict[str, float]
    documents: dict[str, Any]
    stderr: dict[str, float] = field(default_factory=dict)
    tasks: tuple[str, ...] | None = None
    limit: float | None = None
    protocol: dict[str, Any] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return self.scheme != "float"


def collect_evals(paths: Iterable[str | Path]) -> list[Run]:
    """Every run under the given files or directories, one :class:`Run` each: quantgate's eval.json, lm-eval's
    own results JSON (``lm_eval --output_path``: ``results_<date>.json``, with its samples files where
    ``--log_samples`` wrote them) and study runs (metrics.json: every cell, float and quantized)."""
    records: list[Run] = []
    seen: set[str] = set()
    for p in map(Path, paths):
        if (p / "metrics.json").is_file():  # a study run: every cell, float and quantized
            records += _study_records(read_metrics(p), p)
            continue
        files = [p] if p.is_file() else _run_files(p)
        if not files:
            raise MissingFile(
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
        out = _evaluation(_read_json(f), f).lm_eval_output
        if out is not None:
            written.add(str(Path(out.results).resolve()))
    lm, unreadable = [], []
    for f in sorted(folder.rglob("results_*.json")):  # lm_eval --output_path DIR
        try:
            data = _read_json(f)
        except InputError as e:
            unreadable.append(e)
            continue
        if _lm_eval_shaped(data):
            lm.append(f)
    found = evals + [f for f in lm if str(f.resolve()) not in written]
    if not found and unreadable:
        raise unreadable[0]
    return found


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``; a one-line InputError naming it otherwise (:func:`quantgate.files.read_json`)."""
    return read_json(file, fix=REWRITE)


REWRITE = "write it again (quantgate eval ... --out, lm_eval --output_path) or leave it out of the runs compared"


def _lm_eval_shaped(data: dict) -> bool:
    lm_eval_keys = "configs" in data or "versions" in data
    return "settings" not in data and isinstance(data.get("results"), dict) and lm_eval_keys


def _file_record(f: Path) -> Run:
    data = _read_json(f)
    if "settings" in data and "results" in data:
        return _eval_record(_evaluation(data, f), f)
    if _lm_eval_shaped(data):
        _check_fields(data, f, ("config", "results"), "lm-eval's results JSON")
        return _lm_eval_record(data, f)
    raise InputError(
        f"{f} is neither quantgate's eval.json (settings, results) nor lm-eval's results JSON (results, "
        f"configs, versions)"
    )


def _evaluation(data: dict, f: Path) -> Evaluation:
    """The :class:`~quantgate.eval.evaluate.Evaluation` of eval.json ``f`` (its object ``data``); a one-line InputError
    naming ``f`` and the field where it is not one (a field missing or of another type) or a number of its
    evaluation is wrong (:func:`_check_numbers`)."""
    try:
        evaluation = Evaluation.from_json(data)
    except RecordError as e:
        raise InputError(f"cannot read {f}: {e}; {REWRITE}") from None
    except InputError as e:  # not an evaluation's object: an unknown field, or an object where a record is
        raise InputError(f"cannot read {f}: not quantgate's eval.json ({e}); {REWRITE}") from None
    _check_numbers(f, "results", evaluation.results, "documents", evaluation.documents)
    return evaluation


def _check_fields(data: dict, f: Path, fields: tuple[str, ...], kind: str) -> None:
    """A one-line InputError naming ``f`` where one of ``fields`` (present and not null) is not a JSON object,
    or an entry of its results or documents (per task) is not one; what the records below read."""
    wrong = [k for k in fields if data.get(k) is not None and not isinstance(data[k], dict)]
    for k in ("results", "documents"):
        if not wrong and isinstance(data.get(k), dict):
            wrong = [f"{k}.{task}" for task, v in data[k].items() if not isinstance(v, dict)][:1]
    if wrong:
        value = data
        for part in wrong[0].split(".", 1):
            value = value[part]
        raise InputError(
            f"cannot read {f}: its field {wrong[0]!r} is a JSON {json_kind(value)}, not an object, as {kind} "
            f"holds; {REWRITE}"
        )


def _check_numbers(f: Path, results_at: str, results: dict, documents_at: str, documents: dict) -> None:
    """A one-line InputError naming ``f`` and the field where a number of its evaluation is wrong (not finite, out
    of range, or a headline its per-document values do not give: :func:`~.records.wrong_evaluation`)."""
    wrong = wrong_evaluation(results_at, results, documents_at, documents)
    if wrong is not None:
        raise InputError(f"cannot read {f}: {wrong}; {REWRITE}")


def _eval_record(evaluation: Evaluation, f: Path) -> Run:
    s = evaluation.settings
    scheme = s.quantization or "float"
    return Run(
        model=s.model or f.parent.name,
        variant=s.variant,
        seed=None,
        scheme=scheme,
        identity=s.model_sha256,
        source=s.source_sha256 if scheme != "float" else None,
        cell=None,
        kind="eval",
        path=str(f),
        tasks=tuple(s.tasks),
        limit=s.limit,
        protocol=_eval_protocol(s),
        documents=evaluation.documents,
        stderr=_stderr(evaluation.results),
        values=_flat(evaluation.results),
    )


def _lm_eval_record(data: dict, f: Path) -> Run:
    """A record of lm-eval's results JSON: its model from ``config.model_args`` (``pretrained``), the
    quantization from those arguments or the checkpoint's config.json, per-document values from its
    samples files where they are beside it."""
    config = data.get("config") or {}
    args = _model_args(config.get("model_args"))
    name = args.get("pretrained") or args.get("model")
    label = str(name or data.get("model_name") or config.get("model") or f.parent.name)
    scheme, source = _lm_eval_quantization(args, name)
    results = {task: _lm_eval_metrics(ms) for task, ms in (data.get("results") or {}).items()}
    documents = _lm_eval_documents(f, results)
    _check_numbers(f, "results", results, "samples", documents)  # metric names without lm-eval's filter (",none")
    return Run(
        model=label,
        variant=None,
        seed=None,
        scheme=scheme,
        identity=None,  # lm-eval records no hash of the weights
        source=source,
        cell=None,
        kind="lm-eval",
        path=str(f),
        tasks=tuple(sorted(results)),
        limit=config.get("limit"),
        protocol=_lm_eval_protocol(data),
        documents=documents,
        stderr=_stderr(results),
        values=_flat(results),
    )


# Pairing: lm-eval's settings that change a task's numbers, so that two runs differing in one are not
# paired (a change between them would not be quantization's): the documents scored (limit), the prompt
# (num_fewshot per task as applied; fewshot_seed, which picks the examples, where a task has any; a chat
# template, system instruction, few-shot as multi-turn; generation arguments), the task's definition (its
# version) and the rolling window (max_length). Not compared: bootstrap_iters (lm-eval's stderr only; compare's
# intervals are its own paired bootstrap over documents), batch_size and device (float rounding only), the
# other seeds (no loglikelihood task draws from them), use_cache. A setting is compared where both runs
# record it (an older eval.json records no task versions, an lm-eval file no max_length).
PROTOCOL = (
    "limit",
    "num_fewshot",
    "fewshot_seed",
    "task_versions",
    "chat_template",
    "system_instruction",
    "fewshot_as_multiturn",
    "gen_kwargs",
    "max_length",
)


def _eval_protocol(s: EvaluationSettings) -> dict:
    """The settings of quantgate's eval.json that change the numbers (:data:`PROTOCOL`): quantgate eval applies
    no chat template, system instruction or generation arguments; ``n_shot`` (per task, as lm-eval applied
    it) where recorded, else ``num_fewshot`` (None: a bundled task's default, 0) for each lm-eval task."""

    shots = s.n_shot
    if shots is None:
        given = s.num_fewshot
        tasks = [t for t in s.tasks if t not in computed()]
        shots = {t: given if given is not None else 0 for t in tasks if given is not None or t in bundled()}
    out = {
        "limit": s.limit,
        "num_fewshot": shots,
        "chat_template": None,
        "system_instruction": None,
        "fewshot_as_multiturn": False,
        "gen_kwargs": None,
        "max_length": s.max_length,
    }
    recorded = {"task_versions": s.task_versions, "fewshot_seed": s.fewshot_seed}  # where this eval.json has them
    return out | {k: v for k, v in recorded.items() if v is not None}


def _lm_eval_protocol(data: dict) -> dict:
    """The same of lm-eval's results JSON: its config's limit, fewshot seed and generation arguments, its
    ``n-shot`` and ``versions``, and the tracker's chat template and system instruction (their sha256)."""
    config = data.get("config") or {}
    out: dict = {}
    if "limit" in config:
        out["limit"] = config["limit"]
    for key, name in (("n-shot", "num_fewshot"), ("versions", "task_versions")):
        if isinstance(data.get(key), dict):
            out[name] = data[key]
    for key, name in (("chat_template_sha", "chat_template"), ("system_instruction_sha", "system_instruction")):
        if key in data:
            out[name] = data[key] or None
    if "fewshot_as_multiturn" in data:
        out["fewshot_as_multiturn"] = bool(data["fewshot_as_multiturn"])
    if "fewshot_seed" in config:
        out["fewshot_seed"] = config["fewshot_seed"]
    if "gen_kwargs" in config:
        out["gen_kwargs"] = config["gen_kwargs"] or None
    return out


def _protocol_differences(a: Run, b: Run) -> list[str]:
    """Where runs ``a`` and ``b`` were evaluated differently (:data:`PROTOCOL`): ``"num_fewshot 0 vs 2
    (quantgate_cloze)"``; per-task settings over the tasks both ran; the fewshot seed only where a shared task
    has examples; few-shot as multi-turn only where a chat template applies."""
    pa, pb = a.protocol, b.protocol
    shared = set(a.tasks or ()) & set(b.tasks or ())
    out = []
    for key in PROTOCOL:
        if key not in pa or key not in pb:
            continue
        x, y = pa[key], pb[key]
        if isinstance(x, dict) and isinstance(y, dict):
            tasks = sorted(t for t in set(x) & set(y) if not shared or t in shared)
            for t in tasks:
                if not _same(x[t], y[t]):
                    out.append(f"{key} {x[t]} vs {y[t]} ({t})")
            continue
        if key == "fewshot_seed":
            shots = [v for p in (pa, pb) for v in (p.get("num_fewshot") or {}).values()]
            if not any(isinstance(v, (int, float)) and v > 0 for v in shots):
                continue
        if key == "fewshot_as_multiturn" and not (pa.get("chat_template") or pb.get("chat_template")):
            continue  # it shapes chat turns only (lm-eval's simple_evaluate records True by default)
        if not _same(x, y):
            out.append(f"{key} {x} vs {y}")
    return out


def _same(x: object, y: object) -> bool:
    """Equal settings: numbers by value (lm-eval's command line records limit 2 as 2.0, versions as 1 or 1.0)."""
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return float(x) == float(y)
    return x == y


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
    from ..quant.imported import describe, quantization_config, sidecar

    source = None
    folder = Path(str(name)) if name else None
    if folder is not None and folder.is_dir():
        saved = sidecar(folder)
        source = saved.source_sha256 if saved else None
    if args.get("scheme"):
        return str(args["scheme"]), source
    truthy = {k for k, v in args.items() if str(v).lower() in ("true", "1")}
    if "load_in_8bit" in truthy:
        return describe({"quant_method": "bitsandbytes", "load_in_8bit": True}).scheme, source
    if "load_in_4bit" in truthy:
        return describe({"quant_method": "bitsandbytes", "load_in_4bit": True}).scheme, source
    if truthy & {"autogptq", "gptqmodel"}:
        return "gptq", source
    if folder is not None and (folder / "config.json").is_file():
        file, fix = folder / "config.json", "restore the config.json saved with the model"
        cfg = read_json(file, fix=fix)
        own = checked_record(cfg, file, fix).quantization
        if own is not None and own.scheme:
            return own.scheme, source or own.source_sha256
        qc = quantization_config(cfg)
        if qc is not None:
            return describe(qc).scheme, source
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
    date = f.stem.rsplit("_", 1)[-1]
    docs = {}
    for task in results:
        samples = f.with_name(f"samples_{task}_{date}.jsonl")
        if not samples.is_file():
            continue
        rows = [row for _, row in read_json_lines(samples)]
        if rows and all(isinstance(r, dict) and "doc_id" in r and "filter" in r for r in rows):
            docs[task] = sample_documents(rows, {}, None).to_json()  # as eval.json holds it
    return docs


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


def _study_records(metrics: StudyRecord, path: Path) -> list[Run]:
    out = []
    for c in metrics.cells:
        model, cell = f"{metrics.settings.name}:{c.model}", f"{path}#{c.id}"  # a cell's runs are one model's
        runs = {"float": (c.float_documents, c.float_results)} | {
            s: (r.documents, r.results) for s, r in c.schemes.items()
        }
        out += [
            Run(model, c.variant, c.seed, scheme, None, None, cell, "study", str(path), _flat(results), documents)
            for scheme, (documents, results) in runs.items()
        ]  # a study's cells are evaluated alike, by construction: no protocol to compare
    return out


def _references(records: list[Run], baseline: Run | None, force: bool = False) -> list[tuple[Run | None, str]]:
    """Per record, the run its change is measured against and how they were paired: ``baseline`` where
    one is given (refused, unless ``force``, where the record's recorded source sha256 is not the baseline's
    or the two were evaluated differently: :func:`_baseline_conflicts`); else a study cell's float run; else,
    for a quantized run, the float run whose identity (sha256 of its weights) is the quantized run's source
    hash and that was evaluated alike (:func:`_protocol_differences`). Never by name or label alone."""
    floats = [r for r in records if not r.quantized]
    out: list[tuple[Run | None, str]] = []
    refused: list[tuple[Run, list[str]]] = []  # records the baseline is no fit reference for
    for r in records:
        if baseline is not None:
            if r is baseline:
                out.append((None, "baseline"))
                continue
            conflicts = _baseline_conflicts(r, baseline)
            if conflicts:
                refused.append((r, conflicts))
            out.append((baseline, "--baseline" + (f", --force-baseline: {'; '.join(conflicts)}" if conflicts else "")))
        elif r.cell is not None:
            ref = next((f for f in floats if f.cell == r.cell), None)
            out.append((ref, "study cell") if r.quantized and ref is not None else (None, ""))
        elif not r.quantized:
            out.append((None, ""))
        elif r.source:
            found = [f for f in floats if f.identity == r.source]
            alike = [f for f in found if not _protocol_differences(f, r)]
            same = [f for f in alike if (f.tasks, f.limit) == (r.tasks, r.limit)]
            ref = next(iter(same or alike), None)
            short = r.source[:12]
            if ref is not None:
                out.append((ref, f"source sha256 {short}"))
            elif found:
                why = "; ".join(_protocol_differences(found[0], r))
                out.append((None, f"none: the float run with sha256 {short} was evaluated differently ({why})"))
            else:
                out.append((None, f"none: no float run has sha256 {short}"))
        else:
            out.append((None, "none: no source hash recorded; pass --baseline"))
    if refused and not force:
        assert baseline is not None
        r, conflicts = refused[0]
        more = f" (and {len(refused) - 1} more run(s))" if len(refused) > 1 else ""
        raise InputError(
            f"--baseline {baseline.path} is no fit reference for {r.path}{more}: {'; '.join(conflicts)}; "
            f"give its own float run as --baseline, or pass --force-baseline to pair them anyway (stated in "
            f"the table)"
        )
    return out


def _baseline_conflicts(r: Run, baseline: Run) -> list[str]:
    """Why ``baseline`` is no reference for run ``r``: ``r`` records the sha256 of its float source and the
    baseline's weights have another; or the two were evaluated differently (:func:`_protocol_differences`)."""
    out = []
    if r.quantized and r.source and baseline.identity and r.source != baseline.identity:
        out.append(f"its recorded source sha256 {r.source[:12]} is not the baseline's sha256 {baseline.identity[:12]}")
    differences = _protocol_differences(baseline, r)
    if differences:
        out.append("evaluated differently: " + ", ".join(differences))
    return out


def compare(
    paths: Iterable[str | Path],
    out: str | Path | None = None,
    baseline: str | Path | None = None,
    force_baseline: bool = False,
) -> str:
    """Markdown table of every run, with each quantized run's change from its float reference and the
    change's 95% interval (a paired bootstrap over the documents both runs kept; a point change marked
    ``[n/a]`` otherwise). The reference is, with ``baseline`` (a run directory or a results file), that
    run for every other; else a study cell's float run, or the float run whose weights' sha256 is the
    quantized run's recorded source (:func:`_references`). A ``baseline`` whose sha256 is not a quantized run's
    recorded source, or that was evaluated differently (few-shot, task version, limit, ...), is refused unless
    ``force_baseline``: then each such pairing is stated in its row and in a note. Every metric each task
    reports is shown (the headline ones first). With ``out``, also compare.md, compare.csv (the change and its
    interval bounds as numbers) and compare.png there."""
    if force_baseline and baseline is None:
        raise InputError("--force-baseline applies to a --baseline: give one, or leave it out")
    if out is not None:
        claim_output(out, "compare", mark=True)  # before reading the runs: empty, or a comparison quantgate wrote
    records = collect_evals(paths)
    base = None
    if baseline is not None:
        found = collect_evals([baseline])
        if len(found) != 1:
            raise InputError(
                f"--baseline {baseline} holds {len(found)} runs; name one run (an eval.json, an lm-eval results "
                f"file, or a directory holding just one)"
            )
        base = found[0]
        key = (base.path, base.cell, base.scheme)
        records = [base] + [r for r in records if (r.path, r.cell, r.scheme) != key]
    metrics = sorted({m for r in records for m in r.values}, key=_metric_order)
    records.sort(key=lambda r: (r is not base, r.model, str(r.variant), r.seed or 0, r.quantized, r.scheme))
    rows, notes = [], []
    for r, (ref, how) in zip(records, _references(records, base, force_baseline), strict=True):
        if "--force-baseline" in how:
            notes.append(f"{r.model} {r.scheme} ({r.path}) paired with --baseline by {how.split(', ', 1)[1]}")
        shown = {}
        for m in metrics:
            d = None
            task, metric = m.split("/", 1)
            if ref is not None:
                ours, theirs = r.documents.get(task), ref.documents.get(task)
                try:
                    d = change(metric, ref.values.get(m), r.values.get(m), theirs, ours)
                except InputError as e:  # the two runs read different documents: no change between them
                    notes.append(f"{r.model} {r.scheme} vs {ref.model} {ref.scheme}, {m}: {e}")
                if d is not None and d.low is None and d.n == 0:
                    kept = "neither run" if not (theirs or ours) else "one run"
                    notes.append(
                        f"{r.model} {r.scheme}, {m}: point change [n/a], no interval: {kept} kept per-document values"
                    )
            shown[m] = Shown(r.values.get(m), r.stderr.get(m), d)
        reference = f"{ref.model} {ref.scheme} ({how})" if ref is not None else how or None
        rows.append(Row(r.model, r.variant, r.seed, r.scheme, reference, shown))
    table = _markdown(rows, metrics, notes)
    if out is not None:
        out = Path(out)
        write_text_atomic(out / "compare.md", table)
        _write_csv(rows, metrics, out / "compare.csv")
        _plot(rows, metrics, out / "compare.png")
    return table


@dataclass(frozen=True)
class Shown:
    """A metric in a row of the comparison: the run's ``value``, its ``stderr`` (None where the run reported
    none) and its change from the reference (None: no reference, or none computable)."""

    value: float | None
    stderr: float | None
    delta: Delta | None


@dataclass(frozen=True)
class Row:
    """A row of the comparison: the run (``model``, ``variant``, ``seed``, ``scheme``), the ``reference`` its
    changes are from (with how they were paired), and each metric as :class:`Shown`."""

    model: str
    variant: str | None
    seed: int | None
    scheme: str
    reference: str | None
    metrics: dict[str, Shown]

    def run(self) -> list[object]:
        return [self.model, self.variant, self.seed, self.scheme, self.reference]


RUN_COLUMNS = ["model", "variant", "seed", "scheme", "reference"]


def _markdown(rows: list[Row], metrics: list[str], notes: list[str]) -> str:
    """compare.md: a row per run, each metric with its standard error and change, the legends and the notes."""
    lines = table_head(RUN_COLUMNS + [c for m in metrics for c in (m, f"{m} delta")])
    for row in rows:
        cells = [fmt(v) for v in row.run()]
        for m in metrics:
            x = row.metrics[m]
            cells.append(f"{fmt(x.value)} ± {fmt(x.stderr)}" if x.stderr is not None else fmt(x.value))
            cells.append(format_delta(x.delta))
        lines.append(table_row(cells))
    table = "\n".join(lines) + "\n\n" + DELTA_LEGEND + " " + PAIRING_LEGEND + "\n"
    if notes:
        table += "\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes)) + "\n"
    return table


def _metric_order(metric: str) -> tuple:
    """Tasks in the order of :data:`~quantgate.eval.tasks.TASKS` (others after, by name); within a task its headline
    metrics (its row's ``headline``) first."""
    headline = [f"{name}/{m}" for name, t in TASKS.items() for m in t.headline]
    task = metric.split("/", 1)[0]
    tasks = list(dict.fromkeys(h.split("/", 1)[0] for h in headline))
    rank = tasks.index(task) if task in tasks else len(tasks)
    return (rank, task, headline.index(metric) if metric in headline else len(headline), metric)


def _write_csv(rows: list[Row], metrics: list[str], path: Path) -> None:
    """One row per run; each delta as three numbers: the change, and its interval's low and high ends
    (empty for a point change); a metric's stderr where the run reported one."""
    per = ("", " stderr", " delta", " delta low", " delta high")
    fh = io.StringIO(newline="")
    writer = csv.writer(fh)
    writer.writerow(RUN_COLUMNS + [f"{m}{suffix}" for m in metrics for suffix in per])
    for row in rows:
        cells = row.run()
        for m in metrics:
            x = row.metrics[m]
            d = x.delta
            cells += [x.value, x.stderr, *((d.value, d.low, d.high) if d is not None else (None, None, None))]
        writer.writerow(["" if v is None else v for v in cells])
    write_text_atomic(path, fh.getvalue())


def _plot(rows: list[Row], metrics: list[str], path: Path) -> None:
    def label(r: Row) -> str:
        # short: a path's last part, a scheme's name without its details in parentheses
        parts = [Path(r.model).name or r.model, r.variant, r.seed, r.scheme.split(" (")[0]]
        return "\n".join(str(p) for p in parts if p is not None)

    bar_panels({m: [(label(r), r.metrics[m].value) for r in rows] for m in metrics}, path, title="float vs quantized")
