"""A run's log: ``log.jsonl``, one typed record per line (:data:`Event`: the run's config, each logged step, eval and
observe pass), written by :class:`JsonLog` and read by :func:`read_log`, and the same numbers in an accelerate tracker
(:data:`TRACKERS`) with ``log_with``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available

from ..errors import InputError
from ..files import read_json_lines, write_text_atomic
from ..json_record import Count, JsonRecord, NonNegative, Share
from ..plots import save_png
from .checkpoint import ModelIdentity
from .config import TrainConfig

LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class ConfigEvent(JsonRecord):
    """The first line: the run's config (:class:`TrainConfig` as a dict), the model's identity and the processes."""

    config: dict[str, Any]
    identity: ModelIdentity
    world_size: Count
    event: str = "config"


@dataclass(frozen=True)
class TrainEvent(JsonRecord):
    """A logged optimizer step: its mean loss, learning rate, gradient norm (None where not clipped), tokens so far
    and tokens per second since the last one."""

    step: Count
    loss: float
    lr: float
    grad_norm: float | None
    tokens: Count
    tokens_per_s: NonNegative
    event: str = "train"


@dataclass(frozen=True)
class EvalEvent(JsonRecord):
    """The held-out loss at a step."""

    step: Count
    loss: float
    event: str = "eval"


@dataclass(frozen=True)
class LayerPoint(JsonRecord):
    """One block in a light observe pass during training: residual max |x|, kurtosis, sink mass, gate mean."""

    max_abs: NonNegative
    kurtosis: NonNegative | None
    sink_mass: Share | None
    gate_mean: NonNegative | None


@dataclass(frozen=True)
class ObserveEvent(JsonRecord):
    """A light observe pass at a step: per block, and the model's headline numbers."""

    step: Count
    layers: list[LayerPoint]
    max_activation: NonNegative
    max_median_ratio: NonNegative | None
    kurtosis: NonNegative | None
    sink_mass: Share | None
    gate_mean: NonNegative | None
    event: str = "observe"


Event = ConfigEvent | TrainEvent | EvalEvent | ObserveEvent
EVENTS: dict[str, type[Event]] = {
    "config": ConfigEvent,
    "train": TrainEvent,
    "eval": EvalEvent,
    "observe": ObserveEvent,
}
TRACKERS = {"tensorboard": is_tensorboard_available}  # the accelerate trackers a run can log to


def read_log(path: Path) -> list[Event]:
    """The records of log.jsonl ``path``, each typed by its ``event``; a one-line InputError naming the file, the
    line and the field where one is not a record of its event (a line cut off mid-write is refused too)."""
    events: list[Event] = []
    for number, line in read_json_lines(path):
        kind = EVENTS.get(str(line.get("event"))) if isinstance(line, dict) else None
        if kind is None:
            raise InputError(f"{path}: line {number} is not a log record (its event is none of {', '.join(EVENTS)})")
        try:
            events.append(kind.from_json(line))
        except InputError as e:  # a field missing, unknown or of another type (RecordError is one)
            raise InputError(f"{path}: line {number}: {e}") from None
    return events


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

    def write(self, event: Event) -> None:
        record = event.to_json()
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if self.tracker is not None and not isinstance(event, ConfigEvent):
            self.tracker.log(scalars(event), step=event.step)


def scalars(event: TrainEvent | EvalEvent | ObserveEvent) -> dict[str, float]:
    """A logged step's numbers under ``<event>/<name>``; an observe record's per-layer values also as
    ``observe/layer_<i>/<name>`` (None values, such as an ungated model's gate mean, are left out)."""
    out = {
        f"{event.event}/{k}": float(v)
        for k, v in event.to_json().items()
        if k not in ("event", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    for i, layer in enumerate(event.layers if isinstance(event, ObserveEvent) else []):
        out |= {
            f"{event.event}/layer_{i}/{k}": float(v) for k, v in layer.to_json().items() if isinstance(v, (int, float))
        }
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


def plot_training(events: list[Event], path: Path) -> Path | None:
    """Outlier emergence over training from a run's log (:func:`read_log`): loss, residual max |x|, first-token
    attention and gate mean per layer against steps."""
    import matplotlib.pyplot as plt  # at first use: the training loop's import stays light

    train = [e for e in events if isinstance(e, TrainEvent)]
    evals = [e for e in events if isinstance(e, EvalEvent)]
    obs = [e for e in events if isinstance(e, ObserveEvent)]
    if not train:
        return None
    gated = any(L.gate_mean is not None for r in obs for L in r.layers)
    panels = 4 if gated else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6))
    axes[0].plot([r.step for r in train], [r.loss for r in train], label="train")
    if evals:
        axes[0].plot([r.step for r in evals], [r.loss for r in evals], marker="o", label="held-out")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[0].legend(fontsize=8)
    if obs:
        n_layers = len(obs[0].layers)
        cmap = plt.get_cmap("viridis")
        keys = [("max_abs", "residual max |x|", "log"), ("sink_mass", "first-token attention", "linear")]
        if gated:
            keys.append(("gate_mean", "gate mean", "linear"))
        for ax, (key, label, scale) in zip(axes[1:], keys, strict=True):
            for i in range(n_layers):
                ys = [getattr(r.layers[i], key) for r in obs]
                if any(y is not None for y in ys):
                    ax.plot(
                        [r.step for r in obs],
                        [float("nan") if y is None else y for y in ys],
                        marker=".",
                        color=cmap(i / max(n_layers - 1, 1)),
                        label=f"layer {i}" if n_layers <= 8 else None,
                    )
            ax.set(xlabel="step", title=label, yscale=scale)
        if n_layers <= 8:
            axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, Path(path))
