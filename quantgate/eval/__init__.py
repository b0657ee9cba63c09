"""Evaluation: the tasks quantgate ships, one :class:`~quantgate.eval.tasks.Task` row each in
:data:`~quantgate.eval.tasks.TASKS`, and the ones it scores itself (:mod:`quantgate.eval.computed`);
:func:`quantgate.eval.evaluate.evaluate` (lm-eval's tasks and the computed ones, its result an
:class:`~quantgate.eval.evaluate.Evaluation`); lm-eval's ``--model quantgate`` (:mod:`quantgate.eval.lm_eval_models`,
which imports lm-eval); below both, the checks of an evaluation's options and scores (:mod:`quantgate.eval.checks`)
and the model it loads (:mod:`quantgate.eval.load`)."""

from .tasks import TASKS, Task, bundled, computed, rolling

__all__ = ["TASKS", "Task", "bundled", "computed", "rolling"]
