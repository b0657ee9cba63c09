"""What a study run wrote, typed: ``metrics.json`` read into a :class:`StudyRecord` of :class:`CellRecord`\\ s.

The JSON keeps its keys (older runs read the same); these classes are what the report, the plots, the
experiments and the headline script read instead of string keys. Nested measurements that are tables of
their own (an evaluation's ``{task: {metric: value}}`` and per-document columns) stay mappings.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, MissingFile
from ..eval.evaluate import Results
from ..files import json_kind, read_json, write_text_atomic
from ..json_record import Count, JsonRecord, NonNegative, RecordError, Share, json_field
from ..models.cost import GateCost
from ..models.record import CalibrationRecord, MitigationRecord
from ..observe_records import CellObserve, CellSummary, LayerRow
from ..provenance import Machine
from ..stats import METRICS, Documents, TaskDocuments, aggregate, check_cluster
from ..train.log import EvalEvent, Event, LayerPoint, ObserveEvent, TrainEvent
from .compat import keyed
from .grid import cell_dir

__all__ = [
    "SchemeRecord",
    "CellRecord",
    "StudyRecord",
    "read_metrics",
    "write_metrics",
    "wrong_metrics",
    "wrong_evaluation",
]


@dataclass(frozen=True)
class LossPoint(JsonRecord):
    step: Count
    loss: float


@dataclass(frozen=True)
class ObservePoint(JsonRecord):
    """A light observe pass at a training step: per block, and the model's headline numbers."""

    step: Count
    layers: list[LayerPoint]
    max_activation: NonNegative
    sink_mass: Share | None
    gate_mean: NonNegative | None
    kurtosis: NonNegative | None


@dataclass(frozen=True)
class Training(JsonRecord):
    """How a cell's model was trained in the study (``trained`` False, and nothing else, for a model built
    untrained or loaded): steps, tokens, final losses and the curves of its training log."""

    trained: bool = False
    steps: Count = 0
    tokens: Count = 0
    final_train_loss: float | None = None
    final_eval_loss: float | None = None
    curve: list[LossPoint] = field(default_factory=list)
    eval_curve: list[LossPoint] = field(default_factory=list)
    observe_curve: list[ObservePoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return super().to_json() if self.trained else {"trained": False}

    @classmethod
    def of_log(cls, events: list[Event]) -> Training:
        """The summary of a trainer's log.jsonl (:func:`quantgate.train.log.read_log`)."""
        train = [e for e in events if isinstance(e, TrainEvent)]
        evals = [e for e in events if isinstance(e, EvalEvent)]
        last = train[-1] if train else None
        return cls(
            trained=True,
            steps=last.step if last else 0,
            tokens=last.tokens if last else 0,
            final_train_loss=last.loss if last else None,
            final_eval_loss=evals[-1].loss if evals else None,
            curve=[LossPoint(e.step, e.loss) for e in train],
            eval_curve=[LossPoint(e.step, e.loss) for e in evals],
            observe_curve=[
                ObservePoint(e.step, e.layers, e.max_activation, e.sink_mass, e.gate_mean, e.kurtosis)
                for e in events
                if isinstance(e, ObserveEvent)
            ],
        )


def edit_metrics(run_dir: str | Path, edit: Callable[[dict[str, Any]], bool]) -> bool:
    """Apply ``edit`` (which changes a metrics.json object in place and says whether it did) to a run's metrics.json,
    writing the file only where it changed; True where it did."""
    data = _metrics_object(run_dir)
    if not edit(data):
        return False
    write_metrics(run_dir, data)
    return True


def record_cluster(data: dict[str, Any], cluster: str) -> bool:
    """Record ``cluster`` (the unit a report's intervals resample, "work" or "document") in ``data``, a run's
    metrics.json object (its study's report settings; the object otherwise as it was), in place: ``quantgate report
    RUN --cluster``. True where it changed."""
    check_cluster(cluster)
    report = (data.get("study") or {}).get("report")
    if not isinstance(report, dict) or report.get("cluster", "work") == cluster:
        return False
    report["cluster"] = cluster
    return True


@dataclass(frozen=True)
class Observed(JsonRecord):
    """The observe step's result (``<cell>/observe.json``): observe's summary and per-block rows."""

    observe: CellObserve


@dataclass(frozen=True)
class Evaluated(JsonRecord):
    """The eval-float step's result (``<cell>/eval-float.json``): the float model's ``results`` (``{task: {metric:
    value}}``) and ``documents`` (``{task: {column: [one value per document]}}``)."""

    results: Results
    documents: Documents


@dataclass(frozen=True)
class WorstLayer(JsonRecord):
    """A block among a quantized model's three least faithful (:func:`quantgate.quant.quant_error`): its index
    (``layer``) and the SQNR of its output against the float model's (``sqnr_db``, dB)."""

    layer: Count
    sqnr_db: float


@dataclass(frozen=True)
class SchemeRecord(JsonRecord):
    """One scheme's step in a cell: its evaluation (``results``, ``documents``), its error against the float model
    on one held-out batch (``logits_sqnr_db``, dB; the ``worst_layers``; ``overflow``: FP8 values saturated), what
    quantizing recorded (``calibration``, ``mitigation``: None where none ran), how long quantizing took
    (``quantize_s``, seconds; None in runs made before it was recorded) and the step (``seconds``); ``error`` (and
    nothing else) where the hardware could not run it."""

    results: Results | None = None
    documents: Documents = field(default_factory=dict)
    logits_sqnr_db: float | None = None
    worst_layers: list[WorstLayer] = field(default_factory=list)
    overflow: Count = 0
    calibration: CalibrationRecord | None = None
    mitigation: MitigationRecord | None = None
    quantize_s: NonNegative | None = None
    seconds: NonNegative = 0.0
    error: str | None = json_field(omit_none=True)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SchemeRecord:
        """The record of a scheme step's JSON (its cache ``key``, which a step file holds, left out), with the
        works and text hashes of older runs' documents recovered (:func:`~.compat.keyed`)."""
        record = super().from_json({k: v for k, v in data.items() if k != "key"})
        return dataclasses.replace(record, documents=keyed(record.documents))

    @classmethod
    def computed(cls, data: Mapping[str, Any]) -> SchemeRecord:
        """The record of a scheme step's result as it was just computed (its documents as evaluated)."""
        return super().from_json(data)

    def to_json(self) -> dict[str, Any]:
        """The step's JSON as the run writes it (an error step keeps only its error and seconds)."""
        if self.error is not None:
            return {"error": self.error, "seconds": self.seconds}
        return super().to_json()


@dataclass(frozen=True)
class CellRecord(JsonRecord):
    """One cell (model x variant x seed) of a study run. ``source``: the study's source of its model (``preset`` and
    ``config``, or ``load``); ``trained``: how its model was trained here; ``observe``: observe's summary and
    per-block rows (``{}`` in the JSON where there are none); ``cost``: the gate's parameters and FLOPs per token
    (None in runs made before they were recorded); ``float_results`` and ``float_documents``: the float model's
    evaluation (``float`` in the JSON); ``schemes``: each scheme's step; ``seconds``: the cell's steps, summed."""

    id: str
    model: str
    variant: str
    seed: int = 0
    source: dict[str, Any] = field(default_factory=dict)
    trained: Training = field(default_factory=Training)
    observe: CellObserve | None = json_field(none_as={})
    cost: GateCost | None = None
    float_results: Results = json_field(key="float", default_factory=dict)
    float_documents: Documents = field(default_factory=dict)
    schemes: dict[str, SchemeRecord] = field(default_factory=dict)
    seconds: NonNegative = 0.0
    run_dir: Path | None = json_field(stored=False)  # the run directory it was read from
    cluster: str = json_field(stored=False, default="work")  # the unit its intervals resample: the report's cluster

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CellRecord:
        """The record of a cell's JSON, with the works and text hashes of older runs' documents recovered
        (:func:`~.compat.keyed`)."""
        record = super().from_json(data)
        return dataclasses.replace(record, float_documents=keyed(record.float_documents))

    @property
    def summary(self) -> CellSummary:
        """observe's summary over the model (max activation, sink mass, gate mean, ...)."""
        if self.observe is None:
            raise InputError(f"cell {self.id} has no observe record: run its study again (its cached steps are reused)")
        return self.observe.summary

    @property
    def layers(self) -> list[LayerRow]:
        """observe's per-block rows (none where the cell has no observe record)."""
        return self.observe.layers if self.observe else []

    @property
    def is_trained(self) -> bool:
        return self.trained.trained

    @property
    def directory(self) -> Path:
        """The cell's folder in its run (its step files, and ``train/`` for a model trained there)."""
        if self.run_dir is None:
            raise InputError(f"cell {self.id} was not read from a run directory (use read_metrics)")
        return cell_dir(self.run_dir, self.model, self.id)

    def scheme(self, name: str) -> SchemeRecord:
        """The record of scheme ``name``, an empty one where the cell did not run it."""
        return self.schemes.get(name) or SchemeRecord()


@dataclass(frozen=True)
class Fixes(JsonRecord):
    """``report: fixes``: the scheme every other is set against (``reference``) and the perplexity increase a fix
    stays below (``within``, a fraction of the float perplexity)."""

    reference: str
    within: Share = 0.01


@dataclass(frozen=True)
class ReportSettings(JsonRecord):
    """A study's ``report:`` settings as it ran (:data:`~.schema.SECTION_RULES`): the study file's ``notes`` and
    success ``criterion`` (markdown), the ``pairs`` of models the page opens with ([ungated, gated]), the
    ``baseline`` variant every other variant of a model is set against, the ``fixes`` ranking and the ``cluster``
    the intervals resample ("work" or "document")."""

    notes: str = ""
    criterion: str = ""
    pairs: list[list[str]] = field(default_factory=list)
    baseline: str | None = None
    fixes: Fixes | None = None
    cluster: str = "work"


@dataclass(frozen=True)
class SchemeView(JsonRecord, view=True):
    """A model's ``schemes:`` entry as the study ran it, as its report reads it: the scheme's canonical name."""

    scheme: str


@dataclass(frozen=True)
class ModelView(JsonRecord, view=True):
    """A ``models:`` entry as the study ran it, as its report reads it: the model's ``name`` and its ``schemes`` in
    the study file's order."""

    name: str
    schemes: list[SchemeView] = field(default_factory=list)


@dataclass(frozen=True)
class StudyView(JsonRecord, view=True):
    """What the report and compare read of metrics.json's ``study`` (the study file as resolved and run, kept as it
    was written) beside its ``report:`` settings (:attr:`StudyRecord.report`): its ``name`` and ``description``, the
    ``file`` that reruns it ("" for the packaged default; None where the run did not record it) and its ``models``."""

    name: str
    description: str = ""
    file: str | None = None
    models: list[ModelView] = field(default_factory=list)


@dataclass(frozen=True)
class WallSeconds(JsonRecord):
    """How long a study run took, in seconds: this invocation of the study (``this_invocation``, cached steps
    read, not run) and every step of every cell as it was computed (``steps_total``)."""

    this_invocation: NonNegative
    steps_total: NonNegative


@dataclass(frozen=True)
class StudyRecord(JsonRecord):
    """A run's metrics.json: the resolved ``study`` (the study file as run, kept as written; read through
    :attr:`settings`), its ``cells``, the ``schemes`` in order, the ``machine`` it ran on, ``wall_seconds`` and the
    library ``versions``."""

    study: dict[str, Any]
    cells: list[CellRecord]
    schemes: list[str]
    machine: Machine
    wall_seconds: WallSeconds
    versions: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], run_dir: Path | None = None) -> StudyRecord:
        """The record of a metrics.json, its study's settings checked and its cells read from ``run_dir`` with the
        study's report ``cluster``."""
        record = super().from_json(data)
        try:
            cluster = record.report.cluster
            record.settings  # noqa: B018  # what the report reads of the study: checked as the file is read
        except RecordError as e:
            raise e.within("study") from None
        cells = [dataclasses.replace(c, run_dir=run_dir, cluster=cluster) for c in record.cells]
        return dataclasses.replace(record, cells=cells)

    @cached_property
    def settings(self) -> StudyView:
        """What the report and compare read of the study (:class:`StudyView`)."""
        return StudyView.from_json(self.study)

    @cached_property
    def report(self) -> ReportSettings:
        """The study's ``report:`` settings (notes, criterion, pairs, baseline, fixes, cluster)."""
        try:
            return ReportSettings.from_json(self.study.get("report") or {})
        except RecordError as e:
            raise e.within("report") from None


def read_metrics(run_dir: str | Path) -> StudyRecord:
    """The :class:`StudyRecord` of a study run directory (its metrics.json); a one-line InputError naming
    the file where it is truncated, not a study's record or lacks a field the report reads, and naming the field
    (``cells[3].float.quantgate_ppl.word_perplexity``) where a number is not one an evaluation gives: not finite,
    out of range (a perplexity <= 0, an accuracy outside [0, 1], a negative count, a positive log-likelihood),
    or a headline its per-document values do not reproduce; or where a measurement or a timing is not of its
    record's type or outside its range (:mod:`quantgate.json_record`: a kurtosis that is text, a sink mass above 1,
    a negative duration). Every reader (report, compare, the experiments) reads through here, and a study checks
    the same (:func:`wrong_metrics`) before it writes the file; :meth:`StudyRecord.from_json` alone builds records
    from data in memory without the checks of the evaluations' numbers."""
    data = _metrics_object(run_dir)
    record, wrong = _checked(data, Path(run_dir))
    if record is None:
        raise InputError(f"cannot read {Path(run_dir) / 'metrics.json'}: {wrong}; {_regenerate(run_dir, data)}")
    return record


def _metrics_object(run_dir: str | Path) -> dict[str, Any]:
    """The JSON object of a run's metrics.json, as written: the one read of the file (:func:`read_metrics` types
    it, :func:`edit_metrics` edits it); a one-line error naming the file where it is missing or cannot be read."""
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise MissingFile(f"{run_dir} has no metrics.json: run the study first (quantgate study ...)")
    return read_json(path, fix=_regenerate(run_dir, None))


def write_metrics(run_dir: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as a run's metrics.json (one space of indent, keys sorted): the one writer of the file, for
    a study's run and :func:`edit_metrics`."""
    write_text_atomic(Path(run_dir) / "metrics.json", json.dumps(data, indent=1, sort_keys=True))


def wrong_metrics(data: dict[str, Any]) -> str | None:
    """What keeps ``data`` (a metrics.json's object) from being read by :func:`read_metrics`, in words (``not a
    study's metrics.json (...)``, ``cells[0].observe.summary.sink_mass is 5, not a finite number in [0, 1]``);
    None where nothing does."""
    return _checked(data, None)[1]


def _checked(data: dict[str, Any], run_dir: Path | None) -> tuple[StudyRecord | None, str | None]:
    """(the record of ``data``, None), or (None, what is wrong with it)."""
    try:
        record = StudyRecord.from_json(data, run_dir)
    except RecordError as e:  # a field missing, or of another type, or outside its range
        return None, str(e)
    except InputError as e:  # not a record's object: a field the records lack
        return None, f"not a study's metrics.json ({e})"
    wrong = _wrong_numbers(record)  # a value out of range, or a headline its per-document values disagree with
    return (None, wrong) if wrong is not None else (record, None)


def _regenerate(run_dir: str | Path, data: Any) -> str:
    """What to do about a metrics.json that cannot be read: write it again from the run's cached steps (the
    study's own command where the file names it), or restore it."""
    study = data.get("study") if isinstance(data, dict) else None
    file = study.get("file") if isinstance(study, dict) else None
    named = ("" if file == "" else f"{file} ") if isinstance(file, str) else "<its study file> "
    command = f"quantgate study {named}--out {run_dir}"
    return f"regenerate it with {command} (its cached steps are reused), or restore the file"


# --- the numbers of each evaluation: finite, in range, and the headline agreeing with its documents ----------

COUNT_COLUMNS = ("words", "bytes", "tokens", "tokens_after_first", "copies", "copied")  # whole numbers >= 0
LOGLIKELIHOOD_COLUMNS = ("loglikelihood", "loglikelihood_after_first")  # log-probabilities: <= 0
SHARE_COLUMNS = ("acc", "acc_norm")  # per document: in [0, 1]
AGREE = 1e-6  # relative: a headline recomputed from its per-document values (a ratio of sums) agrees to this


def _wrong_numbers(record: StudyRecord) -> str | None:
    """The first number of a metrics.json a report must not print, as ``<field path> <why>`` (e.g.
    ``cells[3].float.quantgate_ppl.word_perplexity is -5, not a perplexity (a finite number > 0)``); None if
    every evaluation's results and per-document values are finite, in range, and agree."""
    for i, cell in enumerate(record.cells):
        at = f"cells[{i}]"
        evaluations = [(f"{at}.float", cell.float_results, f"{at}.float_documents", cell.float_documents)]
        for scheme, step in cell.schemes.items():
            where = f"{at}.schemes.{scheme}"
            evaluations.append((f"{where}.results", step.results or {}, f"{where}.documents", step.documents))
        for results_at, results, documents_at, documents in evaluations:
            wrong = wrong_evaluation(results_at, results, documents_at, documents)
            if wrong is not None:
                return wrong
    return None


def wrong_evaluation(results_at: str, results: Any, documents_at: str, documents: Any) -> str | None:
    """The first wrong number of one evaluation: its ``{task: {metric: value}}`` and its
    ``{task: {column: [one value per document]}}`` (``*_at``: their paths, as the answer names them), as
    ``<path> is <value>, not <what it must be>``; None where every number is right. The one check of an evaluation
    read back: metrics.json's, a study's cached evaluation steps, eval.json and lm-eval's results in compare. A task's
    documents may come typed (a :class:`TaskDocuments` read already): their columns are checked as the file holds
    them."""
    if isinstance(documents, dict):
        documents = {t: d.to_json() if isinstance(d, TaskDocuments) else d for t, d in documents.items()}
    for at, table in ((results_at, results), (documents_at, documents)):
        if not isinstance(table, dict):
            return f"{at} is a JSON {json_kind(table)}, not an object"
        for task, values in table.items():
            if not isinstance(values, dict):
                return f"{at}.{task} is a JSON {json_kind(values)}, not an object"
    for task, metrics in results.items():
        for metric, value in metrics.items():
            wrong = _wrong_metric(metric, value)
            if wrong is not None:
                return f"{results_at}.{task}.{metric} is {value!r}, not {wrong}"
    for task, columns in documents.items():
        wrong = _wrong_documents(f"{documents_at}.{task}", columns)
        if wrong is not None:
            return wrong
        for metric, value in (results.get(task) or {}).items():
            if metric not in METRICS or METRICS[metric].value not in columns:
                continue
            m = METRICS[metric]
            if m.weight is not None and not m.optional_weight and m.weight not in columns:
                continue
            with np.errstate(all="ignore"):
                recomputed = aggregate(columns, metric)
            if not math.isclose(recomputed, value, rel_tol=AGREE, abs_tol=AGREE):
                how = f"sum {m.value} / sum {m.weight}" if m.weight in columns else f"mean {m.value}"
                return (
                    f"{results_at}.{task}.{metric} is {value!r}, but its per-document values ({documents_at}.{task}: "
                    f"{how}) give {recomputed!r}"
                )
    return None


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a finite number: a float, or an int a float holds (not ``10**400``, past its range)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _wrong_metric(metric: str, value: Any) -> str | None:
    """What an evaluation's ``metric`` must be and ``value`` is not (None: it is)."""
    kind = METRICS[metric].kind if metric in METRICS else None
    if not _is_number(value):
        return "a finite number"
    if kind == "bits" or metric.endswith("_stderr"):
        return None if value >= 0 else "a finite number >= 0"
    if kind == "perplexity" or "perplexity" in metric:
        return None if value > 0 else "a perplexity (a finite number > 0)"
    if kind == "accuracy" or metric.startswith("acc"):
        return None if 0 <= value <= 1 else "an accuracy (a number in [0, 1])"
    return None


def _wrong_documents(at: str, columns: dict[str, Any]) -> str | None:
    """The first wrong per-document value of one task: columns of one length, counts whole and >= 0,
    log-likelihoods finite and <= 0, per-document accuracies in [0, 1]."""
    lengths = {}
    for column, values in columns.items():
        if not isinstance(values, list):
            return f"{at}.{column} is a JSON {json_kind(values)}, not an array (one value per document)"
        lengths[column] = len(values)
    reference = "ids" if "ids" in lengths else next(iter(lengths), None)
    for column, n in lengths.items():
        if reference is not None and n != lengths[reference]:
            return f"{at}.{column} holds {n} values and {at}.{reference} {lengths[reference]}: one per document"
    for column, values in columns.items():
        if column in COUNT_COLUMNS:
            wants, test = "a whole number >= 0", lambda x: float(x).is_integer() and x >= 0
        elif column in LOGLIKELIHOOD_COLUMNS:
            wants, test = "a log-likelihood (a finite number <= 0)", lambda x: x <= 0
        elif column in SHARE_COLUMNS:
            wants, test = "a number in [0, 1]", lambda x: 0 <= x <= 1
        else:
            continue
        for j, x in enumerate(values):
            if not (_is_number(x) and test(x)):
                return f"{at}.{column}[{j}] is {x!r}, not {wants}"
    try:
        docs = TaskDocuments.from_json(columns)
    except InputError as e:  # a column no task records
        return f"{at}: {e}"
    if docs.copied is not None and docs.copies is not None:
        for j, (copied, copies) in enumerate(zip(docs.copied, docs.copies, strict=True)):
            if copied > copies:
                return f"{at}.copied[{j}] is {copied!r}, more than the {copies!r} copies of that document"
    return None
