"""A study's grid: the models it resolves to (:class:`ModelSpec`), the cells they expand into
(:class:`Cell`: model x variant x seed) and where each cell's steps live in a run directory."""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..models.io import Placement
from ..quant.schemes import OPTIONS, get_scheme
from ..train import TrainConfig

__all__ = [
    "DataSettings",
    "ObserveSettings",
    "EvalSettings",
    "PresetSource",
    "LoadSource",
    "ModelSource",
    "SchemeEntry",
    "Written",
    "ModelSpec",
    "Study",
    "Cell",
    "cell_dir",
    "cell_slug",
    "slug",
    "expand_scheme",
    "shrink",
]


@dataclass(frozen=True)
class DataSettings:
    """Where a step reads its batches (``calibration:``): a text source or the backcopy task, ``batches`` of
    ``batch_size`` x ``seq_len`` tokens."""

    data: str
    batches: int
    seq_len: int
    batch_size: int

    def as_dict(self) -> dict[str, Any]:
        """The settings as the study file names them (what the step keys hash)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ObserveSettings(DataSettings):
    """``observe:``: the batches observe reads, and how many first keys count as the sink."""

    sink_tokens: int


@dataclass(frozen=True)
class EvalSettings:
    """``eval:``: the tasks, their limit (one for all, or per task), lm-eval's batch size and, for the
    perplexity tasks, the window in tokens (None: the model's own context). The defaults are the schema's
    (:data:`~quantgate.study.schema.SECTION_KEYS`)."""

    tasks: list[str]
    limit: float | dict[str, float | None] | None
    batch_size: int | str
    max_length: int | None = None  # set only by the study file or for a model trained here

    def as_dict(self) -> dict[str, Any]:
        """The settings as the study file names them (what the step keys hash); no max_length when unset."""
        d = dataclasses.asdict(self)
        return d if self.max_length is not None else {k: v for k, v in d.items() if k != "max_length"}


@dataclass(frozen=True)
class PresetSource:
    """A model built from a preset (``preset:``) with ``config:``'s overrides of its config (empty: none)."""

    preset: str
    config: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The source as config.yaml, metrics.json and the model's step key record it."""
        return {"preset": self.preset, "config": self.config}


@dataclass(frozen=True)
class LoadSource:
    """A model loaded from a checkpoint (``load:``): a packaged model's name, a folder or a hub id."""

    load: str

    def as_dict(self) -> dict[str, Any]:
        """The source as config.yaml, metrics.json and the model's step key record it."""
        return {"load": self.load}


ModelSource = PresetSource | LoadSource  # where a study model comes from: exactly one of preset: or load:


@dataclass(frozen=True)
class SchemeEntry:
    """One scheme a model is quantized with: its canonical name (a ``schemes:`` entry's sweep expanded) and the
    tasks its evaluation runs, a subset of the model's (None: all of them)."""

    scheme: str
    tasks: list[str] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The entry as config.yaml and metrics.json record it."""
        return {"scheme": self.scheme, "tasks": self.tasks}


T = TypeVar("T")


@dataclass(frozen=True)
class Written(Generic[T]):
    """A study file's mapping as the typed value it makes (``value``: a TrainConfig, a Placement) and as the file
    wrote it (``given``: the keys set, in the file's order, with the values YAML read). config.yaml, metrics.json
    and the step keys record ``given``: a default the type fills in (every other TrainConfig field) or a value it
    normalises (Placement's max_memory key "0": GPU 0) is not what the file said, and recording it would change a
    recorded study and the key of every cached step."""

    value: T
    given: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The mapping as the study file wrote it."""
        return self.given

    def replace(self, **changes: Any) -> Written[T]:
        """The same with ``changes`` set (as if the file wrote them, after its own keys)."""
        return Written(dataclasses.replace(self.value, **changes), {**self.given, **changes})  # type: ignore[type-var]


@dataclass
class ModelSpec:
    """One ``models:`` entry, resolved: where the model comes from, how it trains here (None: it does not), the
    variants, schemes and seeds of its cells, and its evaluation, observation and calibration settings (its
    own, else the study's)."""

    name: str
    source: ModelSource
    train: Written[TrainConfig] | None
    variants: list[str]
    schemes: list[SchemeEntry]
    eval: EvalSettings
    observe: ObserveSettings
    seeds: list[int]
    calibration: DataSettings  # the study's, updated by the model's own
    # the dtype the model is observed, quantized and evaluated in ("bfloat16", "float16"); None: float32 (a model
    # trained here trains as its train settings say, then is cast)
    dtype: str | None = None
    # what one of its cells asks of a Ray worker ({"cpus": n, "gpus": n}); None: Resources()'s. The serial
    # executor ignores it; it changes no number, so no step key holds it
    resources: dict[str, float] | None = None
    # accelerate's big-model loading of a `load:` checkpoint; each scheme then quantizes a fresh load in place.
    # Like resources it says where, not what: no step key holds it
    placement: Written[Placement] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The resolved model entry, as config.yaml and metrics.json record it (dtype, resources and placement
        when set)."""
        unset = {f for f in ("dtype", "resources", "placement") if getattr(self, f) is None}
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in unset}
        typed = ("source", "train", "eval", "observe", "calibration", "placement")
        return (
            d
            | {k: v.as_dict() for k in typed if (v := getattr(self, k)) is not None}
            | {"schemes": [s.as_dict() for s in self.schemes]}
        )


@dataclass
class Study:
    name: str
    description: str
    models: list[ModelSpec]
    calibration: DataSettings
    report: dict
    raw: dict = field(default_factory=dict)  # the resolved study, written to config.yaml
    executor: str = "serial"  # where its cells run (quantgate.study.executors); not in raw: it changes no number
    out: Path | None = None  # the run directory the file names (``out:``, relative to it); None: results/<name>

    def cells(self) -> list[Cell]:
        """The grid: every model x variant x seed, in the study's order."""
        out = []
        for m in self.models:
            for variant in m.variants:
                for seed in m.seeds:
                    suffix = f"-seed{seed}" if len(m.seeds) > 1 else ""
                    out.append(Cell(m, variant, seed, f"{m.name}/{variant}{suffix}"))
        return out


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a model's variant at a seed. ``id`` is ``model/variant[-seedN]``."""

    model: ModelSpec
    variant: str
    seed: int
    id: str

    @property
    def slug(self) -> str:
        """The cell's folder name under ``<run>/cells/``."""
        return cell_slug(self.model.name, self.id)


def cell_slug(model: str, cell_id: str) -> str:
    """The folder name of cell ``cell_id`` (``model/variant[-seedN]``) of ``model``: ``model--variant[-seedN]``,
    with the characters a folder name cannot hold replaced."""
    return slug(f"{model}--{cell_id[len(model) + 1 :]}")


def cell_dir(run_dir: str | Path, model: str, cell_id: str) -> Path:
    """Where a run keeps a cell's steps (its JSON files, and ``train/`` for a trained model)."""
    return Path(run_dir) / "cells" / cell_slug(model, cell_id)


def slug(text: str) -> str:
    """``text`` as a file or folder name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def expand_scheme(entry: dict) -> list[str]:
    """The canonical schemes of a ``schemes:`` entry: ``{scheme: S, <option>: value or [values], ...}``,
    one per combination of the listed values (``a_bits: [8, 6, 5, 4]``: a bit sweep)."""
    options = {k: v if isinstance(v, list) else [v] for k, v in entry.items() if k in OPTIONS}
    names = []
    for values in itertools.product(*options.values()):
        given = ",".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in zip(options, values, strict=True)
        )
        names.append(str(get_scheme(f"{entry.get('scheme', '')}:{given}" if given else entry.get("scheme", ""))))
    return list(dict.fromkeys(names))


def shrink(study: Study) -> Study:
    """The same study at a budget of seconds (a pipeline check): the first variant, seed and scheme of
    each model, 4 training steps of 2 x 32 tokens, one batch or item per evaluation, calibration and
    observation."""
    small: dict[str, Any] = {"seq_len": 32, "batch_size": 2}
    models = []
    for m in study.models:
        train = (
            None
            if m.train is None
            else m.train.replace(**small, steps=4, eval_every=0, observe_every=2, eval_batches=1, grad_accum=1)
        )
        models.append(
            dataclasses.replace(
                m,
                train=train,
                variants=m.variants[:1],
                seeds=m.seeds[:1],
                schemes=m.schemes[:1],
                eval=dataclasses.replace(m.eval, limit=1),
                observe=dataclasses.replace(m.observe, **small, batches=1),
                calibration=dataclasses.replace(m.calibration, **small, batches=1),
            )
        )
    return dataclasses.replace(
        study, models=models, calibration=dataclasses.replace(study.calibration, **small, batches=1)
    )
