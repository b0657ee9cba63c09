"""The evaluation tasks quantgate ships, one :class:`Task` row each in :data:`TASKS`: what a task scores, the
metrics it leads with, its unit, and, for a task quantgate scores itself, the function that does. Everything that
treats tasks differently (evaluate, a study's steps and report, compare, data parallelism) reads these rows; a new
task is a row (``TASKS.add``), and an lm-eval YAML under ``quantgate/tasks/`` where lm-eval scores it. The rows:

* ``quantgate_passages``: loglikelihood_rolling over the held-out test split cut into passages of at most 256
  words, in turn from each work, so that works contribute comparable words (word_perplexity, byte_perplexity,
  bits_per_byte);
* ``quantgate_ppl``: the same over whole test documents (three plays hold 74% of the words of the first 24);
* ``quantgate_cloze``: LAMBADA-style last word (perplexity, acc);
* ``quantgate_nextsent``: 4-way next sentence (acc, acc_norm);
* ``quantgate_mlm_ppl`` (masked LMs): exp of the mean cross-entropy on 15% masked tokens of the test
  split with a fixed masking seed, as Bondarenko et al. report; computed here, since lm-eval has no
  masked-LM request type.
* ``quantgate_backcopy`` (causal LMs trained on the synthetic backcopy task): perplexity and the
  accuracy of the copied tokens (the one place the task needs attention) on held-out sequences of
  the same task; computed by quantgate (:mod:`.computed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.synthetic import is_backcopy
from ..registry import Registry
from ..stats import TaskDocuments
from . import computed as scorers

__all__ = [
    "Task",
    "TASKS",
    "TASK_DIR",
    "bundled",
    "computed",
    "rolling",
    "perplexity_keys",
    "accuracy_keys",
    "read_on",
    "PERPLEXITY_LEGEND",
]

TASK_DIR = Path(__file__).parent.parent / "tasks"  # the lm-eval YAMLs of the tasks lm-eval scores, and their loaders


@dataclass(frozen=True)
class Task:
    """One evaluation task. ``name``: lm-eval's task name; ``scores``: the models it is for, in words (its refusal of
    another says so), and ``objective`` (``clm``, ``mlm``; None: any model lm-eval scores); ``perplexity`` and
    ``accuracy``: its headline metrics (None: it has none of that kind), and ``perplexity_without_first`` the
    perplexity without a sequence's first prediction, where it reports one; ``headline``: the metrics compare shows
    first; ``unit``: what one of its documents is (``documents``, or ``sequences`` drawn in batches of 16);
    ``rolling``: a window over whole documents, as long as the model was trained on (a study sets its
    ``max_length``). ``trained_on`` (a task for models trained on a synthetic task): whether a model's recorded
    training data (``backcopy:...``) is that task's. ``compute`` (a task quantgate scores itself, not lm-eval): the
    per-document columns of ``(model, tokenizer, limit)``, from which ``results`` gives its metrics."""

    name: str
    scores: str = "any model"
    objective: str | None = None
    perplexity: str | None = None
    accuracy: str | None = None
    perplexity_without_first: str | None = None
    headline: tuple[str, ...] = ()
    unit: str = "documents"
    rolling: bool = False
    trained_on: Callable[[str], bool] | None = None
    compute: Callable[[Any, Any, int | float | None], TaskDocuments] | None = None
    results: Callable[[TaskDocuments], dict[str, float]] | None = None


def _mlm(model: Any, tokenizer: Any, limit: int | float | None) -> TaskDocuments:
    return scorers.mlm_documents(model, tokenizer, limit=limit)


def _backcopy(model: Any, tokenizer: Any, limit: int | float | None) -> TaskDocuments:
    return scorers.backcopy_documents(model, tokenizer, limit=limit)


TEXT = ("word_perplexity", "bits_per_byte")
TASKS: Registry[str, Task] = Registry.named(
    "evaluation task",
    [
        Task("quantgate_passages", perplexity="word_perplexity", headline=TEXT, rolling=True),
        Task("quantgate_ppl", perplexity="word_perplexity", headline=TEXT, rolling=True),
        Task("quantgate_cloze", accuracy="acc", headline=("acc",)),
        Task("quantgate_nextsent", accuracy="acc", headline=("acc",)),
        Task(
            "quantgate_mlm_ppl",
            "masked LMs; use quantgate_ppl for causal LMs",
            "mlm",
            "perplexity",
            headline=("perplexity",),
            unit="sequences",
            compute=_mlm,
            results=scorers.mlm_results,
        ),
        Task(
            "quantgate_backcopy",
            "causal LMs trained on the backcopy task",
            "clm",
            "perplexity",
            "copy_acc",
            "perplexity_after_first",
            unit="sequences",
            trained_on=is_backcopy,
            compute=_backcopy,
            results=scorers.backcopy_results,
        ),
    ],
    listing="bundled",
)

# what a study report's perplexity is, task by task
PERPLEXITY_LEGEND = (
    "Perplexity is word perplexity on held-out text for causal LMs (`quantgate_passages`, passages of at most "
    "256 words, or `quantgate_ppl`, whole documents: the task the model's eval names), `quantgate_mlm_ppl` "
    "for masked LMs and `quantgate_backcopy` for models trained on the backcopy task"
)


def bundled() -> tuple[str, ...]:
    """The names of the tasks quantgate ships (offline)."""
    return tuple(TASKS)


def computed() -> tuple[str, ...]:
    """The tasks quantgate scores itself (not lm-eval): every rank of a data-parallel run computes them whole."""
    return tuple(name for name, t in TASKS.items() if t.compute is not None)


def rolling() -> tuple[str, ...]:
    """The tasks whose window is a model's training length in a study."""
    return tuple(name for name, t in TASKS.items() if t.rolling)


def perplexity_keys() -> tuple[tuple[str, str], ...]:
    """(task, metric) of each task's headline perplexity, in table order: a study cell's is the first it has."""
    return tuple((name, t.perplexity) for name, t in TASKS.items() if t.perplexity)


def accuracy_keys() -> tuple[tuple[str, str], ...]:
    """(task, metric) of each task's headline accuracy, in table order."""
    return tuple((name, t.accuracy) for name, t in TASKS.items() if t.accuracy)


def read_on(objective: str, trained_on: str | None) -> Task:
    """The task a model of ``objective`` (``clm``, ``mlm``), trained on the data ``trained_on`` names (None: not
    recorded), is read on where no task is named (quantgate audit): the row of the synthetic task it was trained on,
    else the first row for its objective alone (a masked LM's masked tokens), else the first rolling row (held-out
    text, in passages)."""
    rows = list(TASKS.values())
    trained = [t for t in rows if t.trained_on is not None and trained_on is not None and t.trained_on(trained_on)]
    own = [t for t in rows if t.trained_on is None and t.objective == objective]
    return (trained or own or [t for t in rows if t.rolling])[0]
