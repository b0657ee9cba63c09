"""Evaluation through lm-eval: in-memory float or quantized models, bundled offline tasks, masked LMs.

``qg.evaluate(model, tokenizer, tasks)`` wraps the model in lm-eval's HFLM (causal LMs) or in
``quantgate-mlm`` (masked LMs, scored by pseudo-log-likelihood, Salazar et al. 2020) and runs
``lm_eval.simple_evaluate`` with quantgate's task folder on the include path, for
the bundled tasks, one row each in :data:`quantgate.eval.tasks.TASKS` (its docstring says what each scores).
Standard lm-eval tasks (wikitext, lambada_openai, hellaswag, ...) pass straight through online.
Started as N processes (``quantgate eval --processes N``, torchrun, ``accelerate launch``), lm-eval splits
each task's requests between them in its own data-parallel way (:mod:`quantgate.parallel`) and every rank
returns rank 0's result.

The result is an :class:`Evaluation` record (``result.to_json()``: the dict ``quantgate eval`` writes as eval.json).
Besides each task's metrics, it keeps each document's values (``result.documents[task]``, a
:class:`~quantgate.stats.TaskDocuments` record, as :mod:`quantgate.stats` reads them): the summed log-likelihood
with the document's words, bytes and tokens for perplexity tasks, acc (and acc_norm) per item for multiple-choice
and cloze tasks, the summed log-likelihood and token count per sequence for the computed tasks. From them
:func:`quantgate.stats.paired_delta` puts an interval on the change between two evaluations.

lm-eval's own conventions, for the lm-eval tasks: ``num_fewshot`` (lm-eval's ``--num_fewshot``),
``bootstrap_iters`` (its stderr: 0, the default, computes none; above 0 each metric lm-eval has a
stderr for gets ``<metric>_stderr`` beside it in ``results``), ``output_path`` (the results JSON
``lm_eval --output_path`` writes, by lm-eval's own EvaluationTracker) and ``log_samples`` (its
per-sample jsonl files beside it). The computed tasks are no lm-eval tasks: they are in quantgate's
result (eval.json) only, never in lm-eval's files, and take neither few-shot context nor stderr.
:mod:`quantgate.eval.lm_eval_models` registers the same models with lm-eval (``--model quantgate``,
``--model quantgate-mlm``) for lm-eval's own command line (``quantgate lm-eval``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import types
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from .. import parallel
from ..data.corpus import OfflineError, hub_reachable, text_hash
from ..errors import InputError, MissingDependency
from ..json_record import JsonRecord, json_field
from ..models.families import family_of
from ..models.modes import eval_mode
from ..models.sources import check_vocabulary
from ..models.sources import tokenizer as get_tokenizer
from ..models.swap import variant_of
from ..options import AT_LEAST_1, check_range
from ..provenance import git_commit, versions
from ..quant import fingerprint, quantization_of
from ..stats import METRICS, Documents, TaskDocuments
from .checks import (
    NonFiniteOutputs,
    check_limit,
    check_limit_per_process,
    check_lm_eval_options,
    first_non_finite,
    score_floats,
)
from .computed import scored
from .load import context_length
from .tasks import TASK_DIR, TASKS, bundled, computed

if TYPE_CHECKING:
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

__all__ = [
    "evaluate",
    "Evaluation",
    "EvaluationSettings",
    "LmEvalOutput",
    "Results",
    "require_lm_eval",
    "task_manager",
    "unknown_tasks",
    "sample_documents",
]

log = logging.getLogger("quantgate")
OFFLINE_EQUIVALENTS = {
    "wikitext": "quantgate_ppl",
    "lambada_openai": "quantgate_cloze",
    "lambada_standard": "quantgate_cloze",
    "hellaswag": "quantgate_nextsent",
    "piqa": "quantgate_nextsent",
    "arc_easy": "quantgate_nextsent",
    "arc_challenge": "quantgate_nextsent",
    "winogrande": "quantgate_nextsent",
}


Results = dict[str, dict[str, float]]  # {task: {metric: value}}


@dataclass(frozen=True, kw_only=True)
class LmEvalOutput(JsonRecord):
    """The files lm-eval's EvaluationTracker wrote for an evaluation: its ``results`` file and, with
    ``log_samples``, each task's ``samples`` file (paths)."""

    results: str
    samples: dict[str, str] | None = json_field(omit_none=True)


@dataclass(frozen=True, kw_only=True)
class EvaluationSettings(JsonRecord):
    """What an evaluation ran with, to reproduce its numbers: the ``tasks``; lm-eval's ``limit`` (documents per
    task, or a fraction of them), ``num_fewshot`` as asked and, where an lm-eval task ran, as lm-eval applied it
    (``n_shot``, per task), the tasks' ``task_versions`` and the ``fewshot_seed``; ``bootstrap_iters``,
    ``batch_size``, ``max_length`` (tokens per window); the model's name or path (``model``, None where it has
    none), ``model_sha256`` (:func:`quantgate.quant.fingerprint`), ``family``, ``variant`` and ``dtype``; its
    ``quantization`` (scheme, None for a float model), the tool that made it (``quantization_origin``), the
    float model it came from (``source_sha256``) and the whole ``quantization_record``
    (:func:`quantgate.quant.quantization_of`)."""

    tasks: list[str]
    limit: int | float | None
    num_fewshot: int | None
    n_shot: dict[str, int] | None = json_field(omit_none=True)
    task_versions: dict[str, Any] | None = json_field(omit_none=True)
    fewshot_seed: int | None = json_field(omit_none=True)
    bootstrap_iters: int
    batch_size: int | str
    max_length: int
    model: str | None
    model_sha256: str
    family: str
    variant: str
    quantization: str | None
    quantization_origin: str | None
    source_sha256: str | None
    quantization_record: dict[str, Any] | None
    dtype: str

    @classmethod
    def of(
        cls,
        model: nn.Module,
        tasks: list[str],
        limit: int | float | None,
        num_fewshot: int | None,
        bootstrap_iters: int,
        batch_size: int | str,
        max_length: int | None,
    ) -> EvaluationSettings:
        """The settings of an evaluation of ``model`` as asked (``max_length`` None: the model's context), with the
        model's identity; lm-eval's protocol (``n_shot``, ...) is added once an lm-eval task ran."""
        quant = quantization_of(model)  # quantgate's record, or that of another tool's quantization_config
        return cls(
            tasks=tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            bootstrap_iters=bootstrap_iters,
            batch_size=batch_size,
            max_length=max_length or context_length(model),
            model=getattr(model.config, "_name_or_path", None) or None,
            model_sha256=fingerprint(model),  # identity: quantize() records it as its source_sha256
            family=family_of(model).name,
            variant=str(variant_of(model)),
            quantization=quant.scheme if quant else None,
            quantization_origin=quant.origin if quant else None,
            source_sha256=quant.source_sha256 if quant else None,  # the float model it came from
            quantization_record=quant.with_origin() if quant else None,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        )


@dataclass(frozen=True, kw_only=True)
class Evaluation(JsonRecord):
    """What :func:`evaluate` returns: per task its ``results`` (``{metric: value}``) and ``documents`` (its
    :class:`~quantgate.stats.TaskDocuments`, the columns :mod:`quantgate.stats` reads), lm-eval's files where it
    wrote them (``lm_eval_output``), the ``settings`` and the library ``versions``. ``to_json()`` is quantgate
    eval's eval.json."""

    results: Results
    documents: Documents
    lm_eval_output: LmEvalOutput | None = json_field(omit_none=True)
    settings: EvaluationSettings
    versions: dict[str, str | None]


@lru_cache(maxsize=2)
def task_manager(include_defaults: bool = True) -> TaskManager:
    """lm-eval's task index with quantgate's tasks; without lm-eval's own ~10k task configs (slow to
    index) when only bundled tasks are asked for."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager  # lm-eval is optional: imported at first use

    return TaskManager(include_path=str(TASK_DIR), include_defaults=include_defaults)


def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tasks: str | Iterable[str] = ("quantgate_ppl",),
    *,
    limit: int | float | None = None,
    batch_size: int | str = "auto",
    max_length: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
    output_path: str | os.PathLike[str] | None = None,
    log_samples: bool = False,
    model_args: dict[str, Any] | None = None,
) -> Evaluation:
    """Evaluate ``model`` on lm-eval ``tasks``; returns an :class:`Evaluation`: ``.results[task][metric]``,
    ``.documents[task][column]`` (one value per document), ``.settings`` and ``.versions``, what is needed to
    reproduce the numbers (``.to_json()``: the same as a dict, as eval.json holds it).

    lm-eval's options apply to the lm-eval tasks (not the ones quantgate scores itself, ``eval.tasks.computed``):
    ``num_fewshot`` examples of context (None: each task's default, 0 for the bundled ones; perplexity
    tasks score each document alone whatever it says, as in lm-eval); ``bootstrap_iters`` > 0 adds
    lm-eval's standard error as ``<metric>_stderr`` where lm-eval has one (means in closed form,
    perplexity by that many bootstrap resamples; word/byte perplexity have none); ``output_path``
    writes lm-eval's own results file (``DIR/<model>/results_<date>.json``, or ``NAME_<date>.json``
    for a ``NAME.json`` path) and ``log_samples`` its ``samples_<task>_<date>.jsonl`` beside it, both
    by lm-eval's EvaluationTracker; the paths are returned as ``lm_eval_output``. The computed
    tasks appear in neither file. ``model_args`` (e.g. ``{"pretrained": DIR, "scheme": S}``) is what
    lm-eval's file records as the model's arguments, with ``quantgate`` (``quantgate-mlm``) as its
    model, the lm-eval model that loads the same thing; without it the file records the model as
    lm-eval records any pre-built one (its name, no arguments)."""
    limit = check_limit(limit)
    if batch_size != "auto":  # lm-eval takes "auto" or a count
        check_range("batch_size", batch_size, AT_LEAST_1)
    check_lm_eval_options(num_fewshot, bootstrap_iters, output_path, log_samples)
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model)
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    family = family_of(model)
    check_vocabulary(model, tokenizer)
    _check_tasks(tasks, family.objective)
    lm_tasks = [t for t in tasks if t not in computed()]
    _check_lm_eval_tasks(lm_tasks, tasks, num_fewshot, bootstrap_iters, output_path)
    if batch_size == "auto":
        batch_size = 8 if next(model.parameters()).device.type == "cpu" else "auto"
    settings = EvaluationSettings.of(model, tasks, limit, num_fewshot, bootstrap_iters, batch_size, max_length)
    run = _Run(model, settings)
    if lm_tasks:
        run.lm_eval(tokenizer, lm_tasks, output_path, log_samples, model_args)
    for name in (t for t in tasks if t in computed()):  # scored here (the task's row), not by lm-eval
        task = TASKS[name]
        assert task.compute is not None and task.results is not None
        run.documents[name] = task.compute(model, tokenizer, limit)
        run.refuse_non_finite({name: scored(run.documents[name])})
        run.results[name] = task.results(run.documents[name])
    return run.result()


class _Run:
    """One :func:`evaluate` call's results and documents as they come in, per task, and the record it returns
    (:meth:`result`), which a NonFiniteOutputs error keeps too (as JSON). ``settings``: the call's, to which lm-eval's
    protocol (``n_shot``, ``task_versions``, ``fewshot_seed``) is added where an lm-eval task ran."""

    def __init__(self, model: nn.Module, settings: EvaluationSettings) -> None:
        self.model, self.family, self.settings = model, family_of(model), settings
        self.results: Results = {}
        self.documents: Documents = {}
        self.written: LmEvalOutput | None = None

    def result(self) -> Evaluation:
        return Evaluation(
            results=self.results,
            documents=self.documents,
            lm_eval_output=self.written,
            settings=self.settings,
            versions={
                **versions(("quantgate", "lm_eval", "torch", "transformers", "torchao")),
                "python": platform.python_version(),
            },
        )

    def refuse_non_finite(self, scored: dict[str, list[tuple[Any, list[float]]]]) -> None:
        """Raise NonFiniteOutputs naming the first task and document with a NaN or inf score (``scored``:
        per task, (document id, its scores)), keeping the other tasks' results."""
        bad = {task: found for task, docs in scored.items() if (found := first_non_finite(docs)) is not None}
        if not bad:
            return
        for task in bad:
            self.results.pop(task, None)
            self.documents.pop(task, None)
        task, (doc, value) = next(iter(bad.items()))
        others = f" (and {len(bad) - 1} more task(s): {', '.join(list(bad)[1:])})" if len(bad) > 1 else ""
        raise NonFiniteOutputs(
            f"{task}: document {doc} scores a log-likelihood of {value}{others}: the model's outputs are NaN or inf "
            f"there, so no metric can be computed; find the first non-finite activation (quantgate observe) and "
            f"fix the model or its quantization",
            self.result().to_json(),
        )

    def lm_eval(
        self,
        tokenizer: PreTrainedTokenizerBase,
        lm_tasks: list[str],
        output_path: str | os.PathLike[str] | None,
        log_samples: bool,
        model_args: dict[str, Any] | None,
    ) -> None:
        """The lm-eval tasks, through lm-eval's simple_evaluate (split between the processes where the call is
        one of several), and lm-eval's own output files where ``output_path`` asks for them."""
        model, s = self.model, self.settings
        lm_eval = require_lm_eval()
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices about custom datasets
        lm = _wrap(model, tokenizer, self.family.objective, s.batch_size, s.max_length)
        state = parallel.joined()  # launched as one of N processes: lm-eval splits the requests between them
        if state is not None:  # every rank refuses alike, before the gather a rank with no document would fail in
            check_limit_per_process(s.limit, state.num_processes, lm_tasks, "limit", " (ranks)")
            parallel.share_work(lm, state)
        tracker = _tracker(output_path)
        with eval_mode(model):
            manager = task_manager(include_defaults=any(t not in bundled() for t in lm_tasks))
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=lm_tasks,
                task_manager=manager,
                limit=s.limit,
                batch_size=s.batch_size,  # recorded in lm-eval's config (the model is built already)
                num_fewshot=s.num_fewshot,
                log_samples=True,
                bootstrap_iters=s.bootstrap_iters,
                evaluation_tracker=tracker,
                verbosity="ERROR",
                confirm_run_unsafe_code=False,  # a task's own code never runs (as a checkpoint's never does)
            )
        out = parallel.from_first(out)  # rank 0 holds every rank's samples; the others get None from lm-eval
        self.results.update({task: _clean(metrics) for task, metrics in out["results"].items()})
        self.settings = dataclasses.replace(  # what lm-eval used that changes the numbers (quantgate compare checks it)
            s,
            n_shot=dict(out.get("n-shot") or {}),
            task_versions=dict(out.get("versions") or {}),
            fewshot_seed=(out.get("config") or {}).get("fewshot_seed"),
        )
        self.documents.update(
            {
                task: sample_documents(samples, out["configs"][task], tokenizer)
                for task, samples in out["samples"].items()
                if samples
            }
        )
        self.refuse_non_finite(
            {t: [(x["doc_id"], score_floats(x["resps"])) for x in ss] for t, ss in out["samples"].items()}
        )
        # after sample_documents (lm-eval's sample writer rewrites the samples in place); rank 0 alone writes
        if tracker is not None and parallel.is_first():
            objective_model = "quantgate-mlm" if self.family.objective == "mlm" else "quantgate"
            self.written = _write_lm_eval_output(tracker, out, log_samples, objective_model, model_args, model)
            skipped = [t for t in s.tasks if t in computed()]
            if skipped:
                log.info(f"{', '.join(skipped)}: computed by quantgate, not lm-eval: in quantgate's result only")


def require_lm_eval() -> types.ModuleType:
    """lm_eval, imported where it is used: it is optional (the tasks scored here run without it)."""
    try:
        import lm_eval  # lm-eval is optional: imported at first use
    except ImportError as e:
        raise MissingDependency(f"evaluation needs lm-eval (pip install lm-eval==0.4.13): {e}") from None
    import lm_eval.evaluator

    # lm-eval records the git commit of the working directory by running git with its stderr shown: outside a
    # checkout every evaluation printed "fatal: not a git repository". The same record, quietly
    lm_eval.evaluator.get_git_commit_hash = git_commit
    return lm_eval


def _check_tasks(tasks: list[str], objective: str) -> None:
    if not tasks:
        raise InputError(f"no tasks given; bundled: {', '.join(bundled())}")
    for name in tasks:
        task = TASKS.get(name)
        if task is not None and task.objective not in (None, objective):
            raise InputError(f"{name} scores {task.scores}")
    unknown = unknown_tasks(tasks)
    if unknown:
        raise InputError(
            f"unknown task(s) {', '.join(unknown)}; bundled (offline): {', '.join(bundled())}; "
            f"any lm-eval task name works online (lm-eval ls tasks)"
        )
    remote = [t for t in tasks if t not in bundled()]
    if remote and not hub_reachable():
        hints = ", ".join(f"{t} -> {OFFLINE_EQUIVALENTS[t]}" for t in remote if t in OFFLINE_EQUIVALENTS)
        raise OfflineError(
            f"task(s) {', '.join(remote)} download their data from the Hugging Face hub, which is not "
            f"reachable. Offline, use the bundled tasks: {', '.join(bundled())}" + (f" ({hints})" if hints else "")
        )


def _check_lm_eval_tasks(lm_tasks: list[str], tasks: list[str], num_fewshot, bootstrap_iters: int, output_path) -> None:
    """lm-eval's options need at least one lm-eval task: on computed tasks alone they would do nothing."""
    if lm_tasks:
        return
    asked = [
        name
        for name, on in (
            ("num_fewshot", num_fewshot is not None),
            ("bootstrap_iters", bootstrap_iters > 0),
            ("an output path (lm-eval's results file)", output_path is not None),
        )
        if on
    ]
    if asked:
        raise InputError(
            f"{' and '.join(asked)} apply to lm-eval tasks, and {', '.join(tasks)} are computed by quantgate, "
            f"not lm-eval: drop them, or add an lm-eval task (e.g. quantgate_ppl)"
        )


def _tracker(output_path) -> EvaluationTracker | None:
    """lm-eval's EvaluationTracker for ``output_path``, its folder made first (an unwritable path fails
    here, before the evaluation)."""
    if output_path is None:
        return None
    from lm_eval.loggers import EvaluationTracker  # lm-eval is optional: imported at first use

    path = Path(output_path)
    try:
        (path.parent if path.suffix == ".json" else path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write lm-eval's results to {path}: {e.strerror or e}") from None

    return EvaluationTracker(output_path=str(output_path))


def _write_lm_eval_output(
    tracker: EvaluationTracker, out: dict, log_samples: bool, lm_model: str, model_args: dict | None, model
) -> LmEvalOutput:
    """Write lm-eval's results file (and with ``log_samples`` its per-task samples files) as ``lm_eval
    --output_path`` does (lm_eval/_cli/run.py), through lm-eval's own tracker; the paths written."""
    if model_args is not None:  # what `lm_eval --model quantgate --model_args ...` would record
        out["config"]["model"], out["config"]["model_args"] = lm_model, dict(model_args)
    name = getattr(model.config, "_name_or_path", None)
    naming = model_args if model_args is not None else ({"pretrained": name} if name else "")
    general = tracker.general_config_tracker  # simple_evaluate named the model CUSTOM, with a random name
    general.log_experiment_args(
        model_source=lm_model if model_args is not None else general.model_source,
        model_args=naming,
        system_instruction=general.system_instruction,
        chat_template=general.chat_template,
        fewshot_as_multiturn=bool(general.fewshot_as_multiturn),
    )
    aggregated = {k: v for k, v in out.items() if k != "samples"}
    samples = out["samples"]
    tracker.save_results_aggregated(results=aggregated, samples=samples if log_samples else None)
    base = Path(tracker.output_path)
    folder = base.parent if base.suffix == ".json" else base / str(general.model_name_sanitized)
    date = getattr(tracker, "date_id", None)
    if base.suffix == ".json":
        results_file = base.with_name(f"{base.stem}_{date}.json")
    else:
        results_file = folder / f"results_{date}.json"
    if date is None or not results_file.is_file():  # lm-eval logs its failure to write and goes on
        raise OSError(f"lm-eval could not write its results under {base} (is it writable?)")
    if not log_samples:
        return LmEvalOutput(results=str(results_file))
    written = {}
    for task in aggregated["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
        path = folder / f"samples_{task}_{date}.jsonl"
        if not path.is_file():
            raise OSError(f"lm-eval could not write its samples of {task} to {path}")
        written[task] = str(path)
    return LmEvalOutput(results=str(results_file), samples=written)


def unknown_tasks(tasks: Iterable[str]) -> list[str]:
    """The names that are neither bundled nor lm-eval tasks (lm-eval's index is read only when needed)."""
    others = [t for t in tasks if t not in bundled()]
    if not others:
        return []
    known = set(task_manager().all_tasks)
    return [t for t in others if t not in known]


def _wrap(model, tokenizer, objective: str, batch_size, max_length):
    """The lm-eval model for ``model``: the classes lm-eval's ``--model quantgate`` / ``quantgate-mlm``
    construct (:mod:`quantgate.eval.lm_eval_models`), so both routes score with the same settings; non-finite scores
    are left to :func:`evaluate`, which names the task and keeps the others."""
    from . import lm_eval_models  # imports lm-eval: optional, imported at first use

    lm: lm_eval_models.QuantgateLM | lm_eval_models.PseudoLogLikelihoodLM
    if objective == "mlm":
        lm = lm_eval_models.PseudoLogLikelihoodLM(model, tokenizer, batch_size=batch_size, max_length=max_length)
    else:
        try:
            lm = lm_eval_models.QuantgateLM(
                pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length
            )
        except (AssertionError, TypeError) as e:
            raise InputError(f"lm-eval cannot wrap this {type(model).__name__}: {e}") from None
    lm.refuse_non_finite = False
    return lm


def _clean(metrics: dict) -> dict:
    """lm-eval's ``{"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...}`` -> ``{"acc": 0.5}``."""
    out = {}
    for key, value in metrics.items():
        name = key.split(",")[0]
        if key != "alias" and isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            out[name] = float(value)
    return out


def sample_documents(samples: list[dict], config: dict, tokenizer: PreTrainedTokenizerBase | None) -> TaskDocuments:
    """Per-document values of one lm-eval task from its logged samples (one filter: the first): the
    per-document value of each metric quantgate.stats aggregates, split where lm-eval logs a pair
    (word_perplexity: (loglikelihood, words)), each document's work where the task records it, and for
    rolling log-likelihood tasks the token count."""
    rows = sorted((s for s in samples if s["filter"] == samples[0]["filter"]), key=lambda s: s["doc_id"])
    columns: dict[str, list] = {}  # the columns METRICS names, as lm-eval logs their metrics
    for name, metric in METRICS.items():
        if name not in rows[0]:
            continue
        values = [s[name] for s in rows]
        if isinstance(values[0], (tuple, list)):  # a weighted aggregation's (value, weight)
            assert metric.weight is not None  # lm-eval logs pairs for the weighted metrics only
            columns[metric.value] = [_number(v[0]) for v in values]
            columns[metric.weight] = [_number(v[1]) for v in values]
        else:
            columns[metric.value] = [_number(v) for v in values]
    docs = [s.get("doc") for s in rows]
    recorded = all(isinstance(d, dict) and "work" in d for d in docs)
    works = [s["doc"]["work"] for s in rows] if recorded else None
    tokens = None
    if config.get("output_type") == "loglikelihood_rolling":  # every token of the text is scored once
        if tokenizer is None:
            raise InputError("a rolling task's documents count their tokens: give sample_documents the tokenizer")
        tokens = [len(tokenizer(s["arguments"][0][0], add_special_tokens=False).input_ids) for s in rows]
    return TaskDocuments(
        ids=[s["doc_id"] for s in rows],
        **columns,
        tokens=tokens,
        works=works,  # the bundled corpus's independent units: works, not chapters of one
        hashes=[_doc_hash(d) for d in docs],
    )


def _doc_hash(doc: Any) -> str:
    """The hash of a logged sample's document: of its ``text`` where it has one, else of the whole document."""
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return text_hash(doc["text"])
    return text_hash(json.dumps(doc, sort_keys=True, default=str))


def _number(v) -> int | float:
    """A JSON-compact number: whole values (hits, counts) as int."""
    v = float(v)
    return int(v) if v.is_integer() else v
