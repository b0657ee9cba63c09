"""Resuming a run from its newest complete checkpoint: the model, settings (:data:`FREE_ON_RESUME`), model
config and optimizer state are checked against this run's before anything loads, then the weights, AdamW's
state, the schedule, the data position, the fp16 scaler and the RNG states are restored."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sized
from dataclasses import asdict
from pathlib import Path
from typing import cast

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from ..data.batches import Resumable
from ..data.synthetic import DataPosition
from ..errors import InputError
from ..files import short_repr
from ..json_record import RecordError
from ..models.io import check_state, read_safetensors
from .checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    Checkpointable,
    ModelIdentity,
    Run,
    TrainerRecord,
    model_settings,
    newest_checkpoint,
)
from .config import FREE_ON_RESUME, TrainConfig, schedule
from .rng import load_rng

log = logging.getLogger("quantgate")


def resume(run: Run, out: Path | None, identity: ModelIdentity, c: TrainConfig) -> None:
    """Restore ``run`` from the newest complete checkpoint of the same model and settings."""
    path, saved = newest_checkpoint(out)
    if saved.identity != identity:
        s = saved.identity
        raise InputError(
            f"{path} belongs to another model ({s.family}, variant {s.variant}, {s.parameters} tensors) than this "
            f"one ({identity.family}, variant {identity.variant}, {identity.parameters} tensors); resume with the "
            f"same model and variant, or train into a new directory"
        )
    now = json.loads(json.dumps(asdict(c)))  # as trainer.json holds it (tuples as lists)
    changed = [
        f"{k} {saved.config.get(k)!r} -> {v!r}"
        for k, v in now.items()
        if k not in FREE_ON_RESUME and saved.config.get(k) != v
    ]
    if saved.world_size != run.acc.num_processes:
        changed.append(f"processes {saved.world_size} -> {run.acc.num_processes}")
    if changed:
        raise InputError(
            f"cannot resume {path} with changed settings: {', '.join(changed)}. They change the data "
            f"or the updates, so the run would match neither config; resume with the saved values, "
            f"or train into a new --out"
        )
    _check_model_settings(run.model, path, saved)
    step = saved.progress.step
    if c.stop_after is not None and c.stop_after <= step:
        raise InputError(
            f"stop_after {c.stop_after}: {path} is at step {step} already; give a later stop_after "
            f"(--stop-after) or none (to the end, step {c.steps})"
        )
    _check_optimizer(run, path, saved, c)
    _check_data_position(run, path, saved, c)
    _load_checkpoint(run, path, saved)
    log.info("resumed from %s", path)


def _check_model_settings(model: nn.Module, path: Path, saved: TrainerRecord) -> None:
    """Refuse to resume a checkpoint with a model whose config differs from the one it was trained with, even
    where the tensor shapes agree (an activation, a norm's eps): one run would mix two architectures."""
    if saved.model_config is None:
        log.warning("%s records no model config (an older quantgate wrote it): resuming without checking it", path)
        return
    was, now = saved.model_config, model_settings(model)
    changed = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if changed:
        raise InputError(
            f"cannot resume {path}: the model's config changed: {', '.join(changed)}. Its weights were trained "
            f"with the saved values: resume with the same model and --config, or train into a new --out"
        )


def _check_optimizer(run: Run, path: Path, saved: TrainerRecord, c: TrainConfig) -> None:
    """The optimizer's and the schedule's saved hyperparameters are the ones this config makes (the learning
    rate: the schedule's at the saved step), so that a resumed run continues the run its config describes."""
    file = path / TRAINER_FILE
    step = saved.progress.step
    fresh = json.loads(json.dumps(run.optimizer.state_dict()["param_groups"]))
    groups = saved.optimizer.param_groups
    if len(groups) != len(fresh):
        raise InputError(
            f"{file}: optimizer.param_groups holds {len(groups)} groups, but this model and config make "
            f"{len(fresh)}; resume the run it belongs to, or train into a new --out"
        )
    factor = schedule(c)(step)
    for i, (got, want) in enumerate(zip(groups, fresh, strict=True)):
        for key in sorted(set(got) | set(want)):
            value = got.get(key)
            if key == "lr":
                expected = want["initial_lr"] * factor
                same = _close(value, expected)
            else:
                expected, same = want.get(key), value == want.get(key)
            if not same:
                raise InputError(
                    f"{file}: optimizer.param_groups[{i}].{key} is {short_repr(value)}, but the run's config makes it "
                    f"{short_repr(expected)} at step {step}; the file was edited or belongs to another run: resume "
                    f"an unedited checkpoint, or train into a new --out"
                )
    lrs = [g["initial_lr"] * factor for g in fresh]
    expected_sched = {**run.scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1}
    for key in sorted(set(saved.scheduler) | set(expected_sched)):
        value, want = saved.scheduler.get(key), expected_sched.get(key)
        if key == "_last_lr":
            same = isinstance(value, list) and len(value) == len(lrs) and all(map(_close, value, lrs))
            want = lrs
        else:
            same = value == json.loads(json.dumps(want))
        if not same:
            raise InputError(
                f"{file}: scheduler.{key} is {short_repr(value)}, but the run's config makes it {short_repr(want)} at "
                f"step {step}; the file was edited or belongs to another run: resume an unedited checkpoint, or "
                f"train into a new --out"
            )


def _check_data_position(run: Run, path: Path, saved: TrainerRecord, c: TrainConfig) -> None:
    """The saved data position (``data.epoch``, ``data.batch``) is the one the saved step makes: each step takes
    ``grad_accum`` global micro-batches, so a run at step s has taken s x grad_accum of them. Another position
    would replay or skip data, and the resumed run would end where no straight run does."""
    if not isinstance(run.data, Resumable):
        return
    file = path / TRAINER_FILE
    try:
        saved_at = DataPosition.from_json(saved.data)
    except InputError as e:  # a value of another type or range (a RecordError), a field missing or unknown
        raise InputError(f"{file}: {e.within('data') if isinstance(e, RecordError) else f'data: {e}'}") from None
    position = (saved_at.epoch, saved_at.batch)
    try:
        per_epoch = len(cast(Sized, run.data))
    except TypeError:  # data of unknown length: its position cannot be derived from the step
        return
    step = saved.progress.step
    taken = step * c.grad_accum
    want = divmod(taken, per_epoch) if per_epoch else (0, 0)
    # after an epoch's last micro-batch the data stands at (epoch, per_epoch): the same place as (epoch + 1, 0)
    same = [want] + ([(want[0] - 1, per_epoch)] if per_epoch and want[1] == 0 and want[0] > 0 else [])
    if tuple(position) in same:
        return
    expected = same[-1]
    key, i = ("batch", 1) if position[0] == expected[0] else ("epoch", 0)
    raise InputError(
        f"{file}: data.{key} is {position[i]}, but the run's config makes it {expected[i]} at step {step} "
        f"({taken} micro-batches taken, {per_epoch} per epoch: data.epoch {expected[0]}, data.batch {expected[1]}); "
        f"the file was edited or belongs to another run: resume an unedited checkpoint, or train into a new --out"
    )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _close(a: object, b: float) -> bool:
    return _number(a) and math.isclose(cast(float, a), b, rel_tol=1e-9)


OPTIMIZER_STATES = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})  # AdamW's, per parameter


def _load_checkpoint(run: Run, path: Path, saved: TrainerRecord) -> None:
    """Restore ``run`` from checkpoint ``path``, reading safetensors and JSON only, each value checked first.
    Every process reads the whole state; under FSDP each keeps its shard of it."""
    weights = read_safetensors(path / MODEL_FILE)
    check_state(run.model, weights, path / MODEL_FILE)
    set_model_state_dict(run.model, dict(weights), options=StateDictOptions(full_state_dict=True, strict=False))
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    file = path / OPTIMIZER_FILE
    for key, t in read_safetensors(file).items():
        index, _, name = key.partition(".")
        i = int(index) if index.isdigit() else -1
        if not 0 <= i < len(params) or name not in OPTIMIZER_STATES:
            raise InputError(
                f"{file}: tensor {key!r} is not '<parameter index>.<AdamW state>' of this model's optimizer"
            )
        want = (1,) if name == "step" else tuple(params[i].shape)
        if ((t.numel(),) if name == "step" else tuple(t.shape)) != want:
            raise InputError(f"{file}: tensor {key!r} has shape {list(t.shape)}; its parameter needs {list(want)}")
        state.setdefault(i, {})[name] = t
    names = run.parameter_names()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved.optimizer.param_groups]
    set_optimizer_state_dict(
        run.model,
        run.inner_optimizer,
        {"state": {names[i]: s for i, s in state.items()}, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
    run.scheduler.load_state_dict(saved.scheduler)
    cast(Checkpointable, run.data).load_state_dict(saved.data)  # checked by check_checkpointable
    if run.acc.scaler is not None:
        if saved.scaler is None:
            raise InputError(f"{path / TRAINER_FILE}: scaler is null, but this run scales its fp16 loss")
        run.acc.scaler.load_state_dict(saved.scaler)
    run.step, run.tokens = saved.progress.step, saved.progress.tokens
    load_rng(path / f"rng-{run.acc.process_index}.safetensors")
