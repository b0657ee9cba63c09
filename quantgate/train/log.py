"""A run's log: ``log.jsonl``, one JSON record per logged step, eval and observe pass, and the same numbers
in an accelerate tracker (:data:`TRACKERS`) with ``log_with``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available

from ..errors import InputError
from ..files import write_text_atomic
from .config import TrainConfig

LOG_FILE = "log.jsonl"

TRACKERS = {"tensorboard": is_tensorboard_available}  # the accelerate trackers a run can log to


def check_tracker(log_with: str | None, out: Path | None) -> None:
    """Refuse a ``log_with`` that is not a tracker of :data:`TRACKERS`, that has no run directory to write
    into, or whose package is not installed."""
    if log_with is None:
        return
    if log_with not in TRACKERS:
        raise InputError(f"unknown log_with {log_with!r}; valid: {', '.join(TRACKERS)}")
    if out is None:
        raise InputError(f"log_with={log_with} writes into the run directory: give out (--out)")
    if not TRACKERS[log_with]():
        raise InputError(f"log_with={log_with} needs the {log_with} package: pip install {log_with}")


class JsonLog:
    """log.jsonl. A fresh run starts it empty; a resumed one keeps the records up to the checkpoint's step
    (those after it came from the interrupted run and are logged again as the steps are retrained). With a
    ``tracker`` (the Accelerator, its trackers started), each record's numbers go there too (:func:`scalars`)."""

    def __init__(self, path: Path | None, keep_until: int | None, tracker: Accelerator | None = None):
        self.path = path
        self.tracker = tracker
        if path is None:
            return
        kept = []
        if keep_until is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines() if _step_of(line, keep_until + 1) <= keep_until]
        write_text_atomic(path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if self.tracker is not None and "step" in record:
            self.tracker.log(scalars(record), step=record["step"])


def scalars(record: dict) -> dict[str, float]:
    """A log record's numbers under ``<event>/<name>``; an observe record's per-layer values also as
    ``observe/layer_<i>/<name>`` (None values, such as an ungated model's gate mean, are left out)."""
    event = record["event"]
    out = {
        f"{event}/{k}": float(v)
        for k, v in record.items()
        if k not in ("event", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    for i, layer in enumerate(record.get("layers") or []):
        out |= {f"{event}/layer_{i}/{k}": float(v) for k, v in layer.items() if isinstance(v, (int, float))}
    return out


def hyperparameters(c: TrainConfig) -> dict[str, bool | int | float | str]:
    """The config as TensorBoard hyperparameters: numbers, text and flags as they are, anything else as text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in asdict(c).items()}


def _step_of(line: str, unreadable: int) -> int:
    """The step of a log record (0 for the config record); ``unreadable`` for a line cut off mid-write."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return unreadable
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else unreadable
