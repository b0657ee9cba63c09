"""Running a study: each cell's steps, cached by key.

For each cell a run trains (or loads) -> observes -> evaluates in float -> for each scheme: quantizes,
measures SQNR, evaluates. Every step writes one JSON file atomically under ``<out>/cells/<cell>/`` with a
key: the hash of everything the step depends on (its settings and the keys of the steps before it).
Re-running skips steps whose file carries the current key, so an interrupted study continues where it
stopped and changing one setting re-runs only what depends on it. Files are keyed by content, not by name:
a ``load:`` checkpoint's key holds the sha256 of its files and a local ``hf:`` data source's the sha256 of
its data files (:func:`quantgate.files.content_sha256`, remembered by size, times and inode, so a resume
does not read the weights again), so replacing either re-runs what depends on it. A step file that cannot
be read back (truncated, edited) is computed again, with a warning: one whose key is current too, where its result
fails the checks its record makes (:attr:`Step.record`: types and ranges, an evaluation's numbers as metrics.json's,
:func:`~.records.wrong_evaluation`). metrics.json and report.md are replaced only by a run whose every result
passes those checks (:func:`~.records.wrong_metrics`). Training checkpoints as it goes and
resumes too. One run writes a run directory at a time (it holds the directory's lock,
:mod:`quantgate.runlock`).

Data-parallel (``quantgate study --processes N``, or N processes a launcher started): every process runs every
cell's steps, each building the same model, observing it and quantizing it with the same calibration, and each
evaluation's requests are split between them (:mod:`quantgate.parallel`); rank 0 decides which steps are
cached, holds the lock and writes every file. Training is not split: a study that trains runs in one process.
A cell's model runs on this process's GPU where there is one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from ..data import batches
from ..data.batches import cache_dir, source_sha256
from ..errors import InputError
from ..eval.checks import check_limit_per_process
from ..eval.evaluate import evaluate
from ..eval.tasks import rolling
from ..files import claim_output, content_sha256, folder_name, read_json, write_text_atomic
from ..json_record import JsonRecord
from ..model_files import load
from ..models import build
from ..models.cost import GateCost, gate_cost
from ..models.families import family_of
from ..models.io import DTYPES
from ..models.record import record_of
from ..models.sources import PACKAGED, package_dir, resolve
from ..models.sources import tokenizer as get_tokenizer
from ..observe import observe
from ..observe_records import CellObserve
from ..options import AT_LEAST_0
from ..parallel import from_first, is_first, joined
from ..provenance import machine, versions
from ..quant import HardwareUnavailable, quant_error, quantize
from ..quant.error import float_outputs
from ..quant.schemes import get_scheme
from ..registry import Registry
from ..runlock import run_lock
from ..train import TrainConfig, can_resume, train
from ..train.log import read_log
from ..yaml_file import yaml_text
from .compat import dtype_key, evaluation_key, file_format, step_key, versioned_key
from .executors import run_cells
from .grid import (
    Cell,
    DataSettings,
    EvalSettings,
    LoadSource,
    ModelSpec,
    ObserveSettings,
    SchemeEntry,
    Study,
    shrink,
    slug,
)
from .records import (
    CellRecord,
    Evaluated,
    Observed,
    SchemeRecord,
    StudyRecord,
    Training,
    WallSeconds,
    write_metrics,
    wrong_evaluation,
    wrong_metrics,
)
from .report import write_study_report
from .schema import DEFAULT_STUDY, load_study

__all__ = ["run_study", "plan", "quantize_calibrated"]

log = logging.getLogger("quantgate")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a step's file (its result, key, seconds and format): the one writer of the files :func:`_done` reads."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def _done(
    path: Path,
    key: str,
    needs: tuple[str, ...] = (),
    version: int = 1,
    record: Callable[[dict[str, Any]], Any] | None = None,
) -> dict | None:
    """The step's cached result where ``path`` holds one with ``key`` (and the fields ``needs``) that its
    ``record`` (the step's :attr:`Step.record`) accepts, with its ``seconds`` a duration; None where there is none
    to use: no file, another key, or a file that cannot be read back (then with a warning, which names the step's
    format ``version`` where the file's differs, or what its record refused)."""
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except InputError as e:
        log.warning("  %s; computing that step again", e)
        return None
    if data.get("key") != key:  # another key (a setting it depends on, or the step's code, changed), or none
        was, now = file_format(data), version
        if not isinstance(data.get("key"), str):  # a file without its key cannot say what it was computed from
            log.warning("  cannot read %s: it records no key; computing that step again", path)
        elif was != now:
            log.warning("  %s was computed by other code (step format %s, now %s): computing it again", path, was, now)
        return None
    missing = [k for k in ("key", *needs) if k not in data]
    if missing:
        log.warning("  cannot read %s: it lacks %s; computing that step again", path, ", ".join(missing))
        return None
    data = {k: v for k, v in data.items() if k != "format"}
    wrong = _wrong_step(data, record)
    if wrong is not None:
        log.warning("  cannot read %s: %s; computing that step again", path, wrong)
        return None
    return data


def _wrong_step(result: dict[str, Any], record: Callable[[dict[str, Any]], Any] | None) -> str | None:
    """What keeps a step's ``result`` from being used: its ``seconds`` not a duration, or its ``record`` refusing
    it (a value of another type or out of range, a wrong evaluation); None where nothing does."""
    seconds = result.get("seconds", 0.0)
    if isinstance(seconds, bool) or seconds not in AT_LEAST_0:
        return f"its seconds are {seconds!r}, not a finite number >= 0"
    if record is None:
        return None
    try:
        record(result)
    except InputError as e:  # the record's refusal: a field missing, of another kind or out of range (RecordError)
        return str(e)
    return None


CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.gguf", "*.bin", "*.model", "*.txt", "*.tiktoken", "*.jinja")


def _content_keys(m: ModelSpec) -> list[str]:
    """What the model's key holds beside its settings: the sha256 of a ``load:`` checkpoint's files (a local
    folder, a packaged model's, or a hub id's snapshot, fetched here: a repository pushed to since is another
    model) and of the local data files it trains on. Empty where there are none: a model without such files keeps
    the key its settings give."""
    memo = cache_dir() / "content-sha256.json"
    keys = []
    if isinstance(m.source, LoadSource):
        load_from = m.source.load
        folder = package_dir(load_from) if load_from in PACKAGED else resolve(load_from)
        keys.append(content_sha256(folder, patterns=CHECKPOINT_FILES, memo=memo))
    data = source_sha256("" if m.train is None else m.train.value.data)
    return keys + ([data] if data else [])


def _data_keys(*sources: str) -> list[str]:
    """The sha256 of the local data files behind ``sources`` (empty for others: their keys are unchanged)."""
    return [k for k in map(source_sha256, sources) if k]


def plan(path: str | Path, processes: int = 1, executor: str | None = None, smoke: bool = False) -> str:
    """A dry run: validate the study and describe its grid (cells, training tokens) without running it; with
    ``processes`` > 1, refuse what that many data-parallel processes cannot split (on ``executor``, default the
    study file's; the study shrunk as ``smoke`` runs it), as :func:`run_study` would once they started."""
    study = load_study(path)
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise InputError(f"--processes must be a whole number >= 1, got {processes!r}")
    if processes > 1:
        _check_data_parallel(shrink(study) if smoke else study, executor or study.executor, processes)
    lines = [
        f"study {study.name}: {len(study.cells())} cells, schemes "
        f"{', '.join(dict.fromkeys(x.scheme for m in study.models for x in m.schemes))}"
    ]
    for cell in study.cells():
        m = cell.model
        if isinstance(m.source, LoadSource):
            verb, untrained = f"fine-tune {m.source.load}", f"load {m.source.load}"
        else:
            preset = " ".join(str(x) for x in (m.source.preset, m.source.config) if x)
            verb, untrained = f"train {preset}", f"build {preset} untrained"
        if m.train is None:
            what = untrained
        else:
            c = m.train.value
            what = (
                f"{verb} on {c.data}: {c.steps} steps x {c.batch_size * c.grad_accum} x {c.seq_len} = "
                f"{c.steps * c.batch_size * c.grad_accum * c.seq_len:,} tokens"
            )
        lines.append(f"  {cell.id} (seed {cell.seed}): {what}; eval {', '.join(m.eval.tasks)}")
    return "\n".join(lines)


def run_study(
    path: str | Path = DEFAULT_STUDY,
    out: str | Path | None = None,
    smoke: bool = False,
    executor: str | None = None,
    address: str | None = None,
) -> Path:
    """Run (or continue) a study; returns the run directory with metrics.json and report.md.
    ``smoke``: the shrunk study (:func:`shrink`), to check a study file end to end in seconds. ``executor``
    (default: the study file's ``executor:``, else serial) and ``address`` (a Ray cluster): where the cells run
    (:mod:`.executors`)."""
    study = load_study(path)
    study = shrink(study) if smoke else study
    if out is None and study.out is None:  # results/<name>: "..", say, would be the current directory
        folder_name(study.name, f"{path}: study name")
    where = Path(out) if out else study.out or Path("results") / study.name
    # before any work: a folder quantgate may write a study run into (empty, or a study run), marked below
    out = claim_output(where, "study", inputs=[path])
    executor = executor or study.executor
    if joined() is not None:
        _check_data_parallel(study, executor)
    # one writer per run directory: a second run on it stops here, naming the first
    with run_lock(out) if is_first() else contextlib.nullcontext():
        if is_first():
            claim_output(out, "study", mark=True, by="quantgate study", inputs=[path])
            write_text_atomic(out / "config.yaml", yaml_text(study.raw))
        started = time.perf_counter()
        records = run_cells(study.cells(), out, _run_cell, executor, address)
        if not is_first():
            return out
        order = list(dict.fromkeys(x.scheme for m in study.models for x in m.schemes))
        metrics = StudyRecord(
            study=study.raw,
            cells=records,
            schemes=order,
            machine=machine(),
            wall_seconds=WallSeconds(
                this_invocation=round(time.perf_counter() - started, 1),
                steps_total=round(sum(r.seconds for r in records), 1),
            ),
            versions=versions(),
        )
        data = metrics.to_json()
        wrong = wrong_metrics(data)  # what read_metrics would refuse: the previous metrics.json is kept
        if wrong is not None:
            raise InputError(
                f"{out}: the run's results cannot be read back ({wrong}); metrics.json and report.md are left as "
                f"they were; run the study again (its valid cached steps are reused)"
            )
        write_metrics(out, data)
        write_study_report(out)
    return out


def _check_data_parallel(study: Study, executor: str, processes: int | None = None) -> None:
    """Refuse what a data-parallel study cannot split: cells on Ray, training, and (given the number of
    ``processes``) an evaluation limit of fewer documents than processes."""
    if executor != "serial":
        raise InputError(
            f"a data-parallel study runs its cells in the processes it was started in; the {executor} executor "
            f"runs them elsewhere: leave out --processes, or the executor"
        )
    trained = [m.name for m in study.models if m.train is not None]
    if trained:
        raise InputError(
            f"a data-parallel study splits evaluation, not training, and {', '.join(trained)} train(s) here: run "
            f"the study in one process, or train with accelerate launch -m quantgate.cli train and load: the model"
        )
    if processes is None:
        return
    for m in study.models:
        for task in dict.fromkeys([*m.eval.tasks, *(t for x in m.schemes for t in x.tasks or ())]):
            one = m.eval.limit.get(task) if isinstance(m.eval.limit, dict) else m.eval.limit
            check_limit_per_process(one, processes, [task], f"{m.name}'s eval limit", f" (--processes {processes})")


class _CellRun:
    """One cell's run, the context its steps read: the cell, its folder ``cdir``, its model's spec, the model's
    key and eval settings, and the model, loaded at first use (a step found done needs none). :meth:`run` reads a
    step from ``cdir``/NAME.json where its key matches, else computes it and writes it there."""

    def __init__(self, cell: Cell, cdir: Path) -> None:
        self.cell, self.cdir, self.spec = cell, cdir, cell.model
        m = cell.model
        train = None if m.train is None else m.train.as_dict()
        parts = ("model", m.source.as_dict(), cell.variant, train, cell.seed, *_content_keys(m), *dtype_key(m.dtype))
        self.model_key = step_key(*parts)
        self.eval = _eval_settings(m)
        self._model: nn.Module | None = None
        self._tokenizer: Any = None
        self.seconds = 0.0

    def model(self) -> nn.Module:
        if self._model is None:
            m = self.spec
            made, tok = _materialise(m, self.cell, self.cdir, self.cell.seed, self.model_key)
            if m.placement is None and (device := _cell_device()) is not None:  # a placed model is where it is
                made = made.to(device)
            self._model, self._tokenizer = made, tok
        return self._model

    def tokenizer(self) -> Any:
        """The model's tokenizer (it outlives a placed model taken by :meth:`to_quantize`)."""
        if self._tokenizer is None:
            self.model()
        return self._tokenizer

    def to_quantize(self) -> nn.Module:
        """The float model for a scheme: a placed one is quantized in place, so the next use loads it afresh."""
        taken = self.model()
        if self.spec.placement is not None:
            self._model = None
        return taken

    def eval_for(self, entry: SchemeEntry) -> EvalSettings:
        """The settings of a scheme's evaluation: the model's, on the entry's tasks where it names some."""
        return dataclasses.replace(self.eval, tasks=entry.tasks or self.eval.tasks)

    def planned(self) -> list[tuple[Step, str, SchemeEntry | None]]:
        """The cell's steps in order: each step, its file's name and the scheme entry it is for (None: the
        step's one file)."""
        return [(step, name, entry) for step in STEPS.values() for name, entry in step.files(self.spec)]

    def run(self, step: Step, name: str, entry: SchemeEntry | None) -> Any:
        """``step``'s record for ``entry`` (what its :attr:`Step.record` gives): read from its file where the file
        holds its key and passes the record's checks, else computed (and written, by rank 0, once it passes them: a
        result that does not is refused, naming the step, and nothing is written)."""
        path = self.cdir / f"{name}.json"
        key = step.key_of(self, entry)
        done = from_first(_done(path, key, step.needs, step.format, step.record) if is_first() else None)
        if done is not None:  # rank 0 read it
            self.seconds += done.get("seconds", 0.0)
            return step.record(done)
        log.info("  %s: %s", self.cell.id, name)
        t0 = time.perf_counter()
        output = step.compute(self, entry).to_json()
        seconds = round(time.perf_counter() - t0, 2)
        result = {"key": key, **output, "seconds": seconds}  # as its file holds it
        wrong = _wrong_step(result, step.record)
        if wrong is not None:
            raise InputError(
                f"{self.cell.id}: its {name} step computed a result quantgate cannot use ({wrong}); nothing was "
                f"written to {path}, metrics.json and report.md are left as they were: look at the cell's model "
                f"(quantgate observe), or leave the scheme or task out of the study"
            )
        self.seconds += seconds
        if is_first():
            _write_json(path, {**result, "format": step.format})
        return step.record(result)


@dataclass(frozen=True)
class Step:
    """One step of a cell's run, the one place that says what it is. ``name``: its file, ``<cell>/NAME.json``
    (a step ``per_scheme`` runs once for each of the model's scheme entries, as ``NAME-<scheme>.json``).
    ``format``: the version of the code behind its output (recorded in its file; part of its key from 2 on:
    :func:`~.compat.versioned_key`). ``key``: what its result depends on, as a key (given the cell's run and the
    scheme entry). ``compute``: its result, a typed record whose ``to_json()`` its file holds (beside the key, the
    seconds and the format). ``needs``: the fields a cached file must have to be used. ``record``: the
    :class:`CellRecord` fields its file's result fills, typed (a ``per_scheme`` step's: its scheme's record, in
    ``CellRecord.schemes``), and the check of a result read back or computed: an InputError (or TypeError) where it
    is not one to use. Each is a named function below."""

    name: str
    format: int
    key: Callable[[_CellRun, Any], str]
    compute: Callable[[_CellRun, Any], JsonRecord]
    record: Callable[[dict[str, Any]], Any]  # per_scheme: a SchemeRecord; else {CellRecord field: value}
    needs: tuple[str, ...] = ()
    per_scheme: bool = False

    def files(self, m: ModelSpec) -> list[tuple[str, SchemeEntry | None]]:
        """The step's files in a cell of ``m``, each with the scheme entry it is for (None: the step's one)."""
        if not self.per_scheme:
            return [(self.name, None)]
        return [(f"{self.name}-{slug(e.scheme)}", e) for e in m.schemes]

    def key_of(self, run: _CellRun, entry: SchemeEntry | None) -> str:
        """The step's key in ``run`` for ``entry``, at its format."""
        return versioned_key(self.key(run, entry), self.format)


# --- the model step: the cell's model built, loaded or trained; its record, how it was trained -----------------


def _model_key(run: _CellRun, entry: None) -> str:
    """The model step's key (and the cost step's): the model's."""
    return run.model_key


def _trained(run: _CellRun, entry: None) -> Training:
    """How the cell's model was trained here (the model built, loaded or trained first)."""
    return _train_summary(run.model, run.cdir)


def _output(result: dict[str, Any]) -> dict[str, Any]:
    """A step's output as its record wrote it: the step's result (its file) without the key and the seconds."""
    return {k: v for k, v in result.items() if k not in ("key", "seconds")}


def _trained_fields(result: dict[str, Any]) -> dict[str, Any]:
    return {"trained": Training.from_json(_output(result))}


# --- the observe step: observe's summary and per-block rows over the observe data -------------------------------


def _observe_key(run: _CellRun, entry: None) -> str:
    """The observe step's key: the model's, the observe settings and the sha256 of their local data files."""
    return step_key(run.model_key, run.spec.observe.as_dict(), *_data_keys(run.spec.observe.data))


def _observed(run: _CellRun, entry: None) -> Observed:
    return _observe(run.model(), run.tokenizer(), run.spec.observe, run.cdir)


def _observed_fields(result: dict[str, Any]) -> dict[str, Any]:
    return {"observe": Observed.from_json(_output(result)).observe}


# --- the eval-float step: the float model's evaluation ---------------------------------------------------------


def _float_key(run: _CellRun, entry: None) -> str:
    """The float evaluation's key: the model's and the eval settings (:func:`~.compat.evaluation_key`)."""
    return evaluation_key(run.model_key, run.eval.as_dict())


def _float_evaluation(run: _CellRun, entry: None) -> Evaluated:
    return _evaluate(run.model(), run.tokenizer(), run.eval)


def _checked_evaluation(out: dict[str, Any]) -> dict[str, Any]:
    """An evaluation step's result (``results``, ``documents``), refused where a number is wrong
    (:func:`~.records.wrong_evaluation`, the check metrics.json gets)."""
    wrong = wrong_evaluation("results", out.get("results") or {}, "documents", out.get("documents") or {})
    if wrong is not None:
        raise InputError(wrong)
    return out


def _float_fields(result: dict[str, Any]) -> dict[str, Any]:
    evaluated = Evaluated.from_json(_checked_evaluation(_output(result)))
    return {"float_results": evaluated.results, "float_documents": evaluated.documents}


# --- the cost step: the gate's parameters and FLOPs per token --------------------------------------------------


def _cost(run: _CellRun, entry: None) -> GateCost:
    return gate_cost(run.model())


def _cost_fields(out: dict[str, Any]) -> dict[str, Any]:
    return {"cost": GateCost.from_json({k: out[k] for k in ("gate_params", "gate_flops_per_token")})}


# --- a scheme step: one scheme applied to the cell's model, its error and its evaluation ------------------------


def _scheme_key(run: _CellRun, entry: SchemeEntry) -> str:
    """A scheme step's key: the model's, the scheme, the settings of its calibration, evaluation and held-out batch,
    and the sha256 of the local data files it reads (:func:`~.compat.evaluation_key`)."""
    m = run.spec
    data = _data_keys(m.calibration.data, m.observe.data)
    cal, ev, ob = m.calibration.as_dict(), run.eval_for(entry).as_dict(), m.observe.as_dict()
    return evaluation_key(run.model_key, entry.scheme, cal, ev, ob, data=data)


def _scheme(run: _CellRun, entry: SchemeEntry) -> SchemeRecord:
    """A scheme step's result: the entry's scheme applied to the cell's model, its error and its evaluation."""
    model, tok = run.to_quantize(), run.tokenizer()
    return SchemeRecord.computed(_quantized(model, tok, entry.scheme, run.eval_for(entry), run.spec, run.cell.seed))


def _scheme_record(out: dict[str, Any]) -> SchemeRecord:
    """A scheme step's record, its evaluation checked (an error step has none)."""
    return SchemeRecord.from_json(out if "error" in out else _checked_evaluation(out))


# A cell's steps, in the order they run: a new step is one entry (and, for the cell's record to hold it, a
# CellRecord field). Raise a step's format when its code starts computing something else (another field, meaning
# or selection): its key then changes, so a cached result of the old code is computed again, and the run says
# which. tests/test_step_formats.py holds each step's output shape at its format and fails when the shape changes
# under the same one; tests/test_step_keys.py holds the keys. Format 2 (observe, eval-float, scheme): per-document
# text hashes.
STEPS: Registry[str, Step] = Registry.named(
    "study step",
    (
        Step("model", 1, _model_key, _trained, _trained_fields),
        Step("observe", 2, _observe_key, _observed, _observed_fields, needs=("observe",)),
        Step("eval-float", 2, _float_key, _float_evaluation, _float_fields, needs=("results", "documents")),
        Step("cost", 1, _model_key, _cost, _cost_fields, needs=("gate_params", "gate_flops_per_token")),
        Step("scheme", 2, _scheme_key, _scheme, _scheme_record, per_scheme=True),
    ),
)


def _run_cell(cell: Cell, cdir: Path) -> CellRecord:
    """Run (or read) each of the cell's steps in turn; its record holds what each step's ``record`` gives."""
    run = _CellRun(cell, cdir)
    fields: dict[str, Any] = {}
    schemes: dict[str, SchemeRecord] = {}
    for step, name, entry in run.planned():
        record = run.run(step, name, entry)
        if entry is None:
            fields |= record
        else:
            schemes[entry.scheme] = record
    source = cell.model.source.as_dict()
    return CellRecord(
        cell.id,
        cell.model.name,
        cell.variant,
        cell.seed,
        source,
        schemes=schemes,
        seconds=round(run.seconds, 1),
        **fields,
    )


def _materialise(m: ModelSpec, cell: Cell, cdir: Path, seed: int, model_key: str):
    """Build or load the cell's model, then train it if the study says so (a loaded one is fine-tuned; a
    variant swapped into a loaded checkpoint starts with gates initialised with the cell's seed); training
    resumes from its checkpoints."""
    train_dir = cdir / "train"
    dtype = DTYPES[m.dtype] if m.dtype else None
    if m.train is not None and (train_dir / "model" / "config.json").is_file() and _same_key(train_dir, model_key):
        model = load(train_dir / "model", dtype=dtype)
        return model, get_tokenizer(model)
    untrained = dtype if m.train is None else None  # a model trained here trains in float32, then is cast
    if isinstance(m.source, LoadSource):
        variant = cell.variant if cell.variant != "vanilla" else None
        placement = m.placement.value if m.placement is not None else None
        model = load(m.source.load, variant, seed=seed, dtype=untrained, placement=placement)
    else:
        model = build(m.source.preset, cell.variant, seed=seed, dtype=untrained, **m.source.config)
    tok = get_tokenizer(model)
    if m.train is not None:
        if not _same_key(train_dir, model_key):
            shutil.rmtree(train_dir, ignore_errors=True)
        claim_output(train_dir, "train", "a study cell's train/", mark=True, by="quantgate study")
        (train_dir / "study-key").write_text(model_key)
        resume = can_resume(train_dir)
        steps = m.train.value.steps
        run = {"out": str(train_dir), "resume": resume, "overwrite": not resume}  # no checkpoint: start afresh
        cfg = TrainConfig(**{"checkpoint_every": max(1, steps // 4), **m.train.given, "seed": seed, **run})
        model = train(model, tok, config=cfg)
        if dtype is not None:
            model = model.to(dtype)
    return model, tok


def _cell_device() -> torch.device | None:
    """Where a cell's model runs: this process's GPU in a data-parallel run, else the first GPU where there is one
    (a Ray cell sees the GPUs it asked for); None: the CPU."""
    if not torch.cuda.is_available():
        return None
    state = joined()
    return state.device if state is not None else torch.device("cuda")


def _same_key(train_dir: Path, key: str) -> bool:
    f = train_dir / "study-key"
    return f.is_file() and f.read_text().strip() == key


def _train_summary(model: Callable[[], nn.Module], cdir: Path) -> Training:
    model()  # builds, trains or loads
    logf = cdir / "train" / "log.jsonl"
    if not logf.is_file():
        return Training()
    return Training.of_log(read_log(logf))


def _observe(model, tok, cfg: ObserveSettings, cdir: Path) -> Observed:
    data = batches(tok, cfg.data, cfg.seq_len, cfg.batch_size, family_of(model).objective, max_batches=cfg.batches)
    report = observe(model, data, sink_tokens=cfg.sink_tokens)
    if is_first():
        report.save(cdir / "observe")
    return Observed(CellObserve.of(report.summary, report.layers))


def _eval_settings(m: ModelSpec) -> EvalSettings:
    """The model's eval settings; a model trained here reads the documents of a perplexity task in windows of
    its training length (beyond it a RoPE model extrapolates and a learned position table is untrained),
    unless max_length says otherwise. Loaded models use their own context (:func:`quantgate.eval.evaluate.evaluate`'s
    default); item tasks (cloze, next sentence) always do: an item must fit whole."""
    if m.train is None or m.eval.max_length is not None or not set(m.eval.tasks) & set(rolling()):
        return m.eval
    return dataclasses.replace(m.eval, max_length=m.train.value.seq_len)


def _evaluate(model, tok, cfg: EvalSettings) -> Evaluated:
    """Metrics per task, and each document's values (the report's paired intervals need them)."""
    results, documents = {}, {}
    for task in cfg.tasks:  # one task at a time: each may carry its own limit
        limit = cfg.limit.get(task) if isinstance(cfg.limit, dict) else cfg.limit
        window = cfg.max_length if task in rolling() else None
        out = evaluate(model, tok, [task], limit=limit, batch_size=cfg.batch_size, max_length=window)
        results.update(out.results)
        documents.update(out.documents)
    return Evaluated(results, documents)


def quantize_calibrated(
    model: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    scheme: str,
    calib: DataSettings,
    seed: int,
    inplace: bool = False,
) -> torch.nn.Module:
    """``model`` quantized with ``scheme`` as a study cell quantizes it: calibrated (where the scheme needs it) on
    ``calib``'s batches, shuffled with the cell's ``seed``."""
    calibration, options = None, dict[str, Any]()
    if get_scheme(scheme).needs_calibration:
        objective = family_of(model).objective
        calibration = batches(tok, calib.data, calib.seq_len, calib.batch_size, objective, shuffle=True, seed=seed)
        options = {"calib": calib.batches}
    return quantize(model, scheme, calibration=calibration, inplace=inplace, **options)


def _quantized(model, tok, scheme: str, ev_cfg: EvalSettings, m: ModelSpec, seed: int) -> dict:
    """``scheme`` applied to ``model`` (in place where the model is placed over devices: a copy might not fit),
    its error against the float model on one held-out batch, and its evaluation."""
    objective = family_of(model).objective
    ob = m.observe
    held_out = batches(tok, ob.data, ob.seq_len, ob.batch_size, objective, max_batches=1)
    reference = float_outputs(model, held_out, max_batches=1)
    start = time.perf_counter()
    try:
        q = quantize_calibrated(model, tok, scheme, m.calibration, seed, inplace=m.placement is not None)
    except HardwareUnavailable as e:  # a scheme this hardware cannot run: recorded, not fatal
        return {"error": str(e)}
    quantize_s = time.perf_counter() - start
    err = quant_error(reference, q)
    quantization = record_of(q).quantization  # the record quantize wrote
    assert quantization is not None
    out = _evaluate(q, tok, ev_cfg)
    return {
        "results": out.results,
        "documents": out.documents,
        "logits_sqnr_db": err.logits_sqnr_db,
        "worst_layers": [w.to_json() for w in err.worst_layers],
        "overflow": err.overflow,
        "calibration": quantization.calibration.to_json() if quantization.calibration else None,
        "mitigation": quantization.mitigation.to_json() if quantization.mitigation else None,
        "quantize_s": quantize_s,
    }
