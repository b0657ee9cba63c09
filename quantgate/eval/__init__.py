"""Evaluation tasks as data: the tasks quantgate ships, one :class:`~quantgate.eval.tasks.Task` row each in
:data:`~quantgate.eval.tasks.TASKS`, and the ones it scores itself (:mod:`quantgate.eval.computed`)."""

from .tasks import TASKS, Task, bundled, computed, rolling

__all__ = ["TASKS", "Task", "bundled", "computed", "rolling"]
