"""The checks of an evaluation, shared by :func:`quantgate.eval.evaluate.evaluate` and lm-eval's models
(:mod:`quantgate.eval.lm_eval_models`): lm-eval's ``limit`` and options, refused in one line before any work, and
the test for non-finite scores (:class:`NonFiniteOutputs`)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import InputError
from .tasks import computed

__all__ = [
    "check_limit",
    "check_limit_per_process",
    "check_lm_eval_options",
    "NonFiniteOutputs",
    "score_floats",
    "first_non_finite",
]


def check_limit(limit: int | float | None) -> int | float | None:
    """lm-eval's ``limit``: None (every document), a whole number of documents >= 1, or a fraction in (0, 1)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise InputError(f"limit must be a number of documents (>= 1) or a fraction in (0, 1), got {limit!r}")
    if limit >= 1 and limit != int(limit):
        raise InputError(f"limit {limit} is neither a whole number of documents nor a fraction below 1")
    return int(limit) if limit >= 1 else float(limit)


def check_limit_per_process(
    limit: int | float | None, processes: int, tasks: Iterable[str], name: str = "--limit", processes_name: str = ""
) -> None:
    """Refuse a whole-number ``limit`` below the number of data-parallel ``processes`` for a task whose documents
    lm-eval splits between them (not the ones quantgate scores itself): a process with no document fails in the
    ranks' gather instead. ``name`` and ``processes_name`` name the settings in the one-line refusal."""
    split = [t for t in tasks if t not in computed()]
    if processes <= 1 or limit is None or limit < 1 or int(limit) >= processes or not split:
        return
    raise InputError(
        f"{name} {int(limit)} gives {', '.join(split)} {int(limit)} document(s) to split between {processes} processes"
        f"{processes_name or f' (--processes {processes})'}, and each needs one: raise the limit to {processes} or "
        f"more, or run fewer processes"
    )


def check_lm_eval_options(
    num_fewshot: int | None = None,
    bootstrap_iters: int = 0,
    output_path: str | os.PathLike[str] | None = None,
    log_samples: bool = False,
) -> None:
    """Refuse, with one line naming the fix, lm-eval options that cannot work: a negative or fractional
    ``num_fewshot`` (examples) or ``bootstrap_iters`` (resamples), ``log_samples`` without ``output_path``,
    an ``output_path`` that is an existing file not named ``*.json``."""
    for name, value in (
        ("num_fewshot (--num-fewshot)", num_fewshot),
        ("bootstrap_iters (--bootstrap-iters)", bootstrap_iters),
    ):
        if value is None and name.startswith("num_fewshot"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name} must be a whole number >= 0, got {value!r}")
    if log_samples and output_path is None:
        raise InputError(
            "log_samples (--log-samples) writes lm-eval's per-sample files beside its results file: "
            "give output_path (--output-path) too"
        )
    if output_path is not None:
        path = Path(output_path)
        if not str(output_path).strip():
            raise InputError("the output path is empty: give a directory or a file name ending in .json")
        if path.suffix != ".json" and path.exists() and not path.is_dir():
            raise InputError(f"output path {path} is a file: give a directory or a file name ending in .json")
        if path.suffix == ".json" and path.is_dir():
            raise InputError(f"output path {path} is a directory named *.json: lm-eval would take it for a file name")


class NonFiniteOutputs(InputError):
    """The model's log-likelihood of a task's document is NaN or inf (its outputs are). ``partial``: the JSON of
    what :func:`~quantgate.eval.evaluate.evaluate` returns (``Evaluation.to_json()``), over the tasks finished
    before it with finite outputs."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


def score_floats(value: Any) -> list[float]:
    """The numbers in a logged sample's responses (nested lists and tuples; strings and flags skipped)."""
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in score_floats(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def first_non_finite(scored: list[tuple[Any, list[float]]]) -> tuple[Any, float] | None:
    """(document id, score) of the first NaN or inf score in ``scored``: (document id, its scores)."""
    return next(((doc, v) for doc, values in scored for v in values if not math.isfinite(v)), None)
