"""Training on HF accelerate: CLM or MLM, from scratch or from a checkpoint, resumable, with outlier,
sink and gate statistics logged as training goes.

The same code runs on a CPU, one GPU, and many (``accelerate launch``; DDP, or FSDP version 2 through an
accelerate config, whose shards are gathered whole for checkpoints and the final model). Every data batch
is a *global* micro-batch; each process trains on its share, so N processes with per-device batch B see
exactly what one process with batch N x B sees.

Output directory (one writer at a time: the run holds ``.quantgate.lock``, see :mod:`quantgate.runlock`)::

    log.jsonl                 one record per logged step, eval and observe pass
    tensorboard/              with ``log_with="tensorboard"`` (``--log-with tensorboard``): the same scalars
                              as TensorBoard events, through accelerate's trackers (``train/loss``,
                              ``eval/loss``, ``observe/sink_mass``, ``observe/layer_<i>/sink_mass``, ...),
                              and the config as hyperparameters. A resumed run appends; TensorBoard shows
                              the steps retrained after the checkpoint twice, log.jsonl keeps them once
    checkpoints/step-N/       everything a resume needs, as safetensors and JSON (never pickle):
        model.safetensors         the unwrapped weights, whole also under FSDP (tied weights stored once)
        optimizer.safetensors     AdamW moments and step counts, whole, keyed "<parameter index>.<name>"
        rng-<rank>.safetensors    each process's torch CPU/CUDA generator states; python's and numpy's
                                  as JSON in its metadata
        trainer.json              format, model identity and config, run config, process count, progress,
                                  optimizer param groups, LR scheduler, data position, fp16 grad scaler;
                                  every field is checked before a resume uses it (:data:`TRAINER_FIELDS`)
    model/                    the final model (``qg.save``), and training.png
    last-good-model/          after a divergence: the last finite weights (see :func:`train`)

A folder is written as ``.<name>.tmp`` beside its place, fsynced, and renamed into place once complete,
so an interrupted write never leaves a partial ``step-N`` or ``model``; the next run removes the
leftover with a warning. ``--resume`` continues from the newest complete checkpoint (skipping, with a
warning, folders that are not one) and refuses changed settings (:data:`FREE_ON_RESUME`), a changed model
config (an activation, a norm's eps: shapes that agree do not make the same model) and optimizer or schedule
state that the config does not make. A run that does not resume refuses a directory holding another run's
files (its model/ and log would describe one run, the checkpoints another) unless ``overwrite`` removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn, Protocol, TypedDict, cast

import numpy as np
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedType, is_tensorboard_available, set_seed
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .checkpoint import save
from .data import batches as text_batches
from .data.batches import Resumable
from .data.synthetic import is_backcopy
from .files import json_kind, publish_folder, read_json, temporary_folder, write_failure, write_text_atomic
from .models.families import config_of, family_of, is_norm
from .models.io import check_state, read_safetensors
from .models.modes import eval_mode
from .models.swap import apply_variant, gate_parameters, variant_of
from .observe import observe
from .options import ABOVE_0, AT_LEAST_0, AT_LEAST_1, Range, check_range, in_range
from .plots import plot_training
from .quant import quantization_of
from .runlock import run_lock

__all__ = ["TrainConfig", "train", "can_resume", "TrainingDiverged", "FAMILY_DEFAULTS", "make_data"]

log = logging.getLogger("quantgate")


class FamilyDefaults(TypedDict):
    """A family's optimiser recipe: the values TrainConfig's ``None`` fields take."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    schedule: str


# The papers' optimiser settings (Bondarenko et al.: OPT lr 4e-4, AdamW(0.9, 0.95), wd 0.1; BERT lr 1e-4, linear
# decay, wd 0.01). Every family names its recipe: the causal families without a paper recipe of their own take
# OPT's, said here; a family missing from this table trains only with all four values given.
OPT_RECIPE: FamilyDefaults = {"lr": 4e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "schedule": "cosine"}
BERT_RECIPE: FamilyDefaults = {"lr": 1e-4, "betas": (0.9, 0.999), "weight_decay": 0.01, "schedule": "linear"}
FAMILY_DEFAULTS: dict[str, FamilyDefaults] = {
    "opt": OPT_RECIPE,
    "bert": BERT_RECIPE,
    "llama": OPT_RECIPE,
    "qwen2": OPT_RECIPE,
    "qwen3": OPT_RECIPE,
    "qwen3-next": OPT_RECIPE,
    "mla": OPT_RECIPE,
}


@dataclass
class TrainConfig:
    """What to train for and how. ``None`` fields take the family's default (:data:`FAMILY_DEFAULTS`)."""

    steps: int = 1000  # optimizer steps of the whole run (sets the schedule)
    stop_after: int | None = None  # end this invocation at this step (checkpointed); --resume continues
    batch_size: int = 16  # sequences per process per micro-step
    seq_len: int = 128
    grad_accum: int = 1
    lr: float | None = None
    schedule: str | None = None  # cosine | linear | constant (after warmup)
    warmup: float = 0.05  # fraction of steps (< 1) or a number of steps
    min_lr_ratio: float = 0.1  # cosine/linear decay ends at lr * min_lr_ratio
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None
    gate_lr: float | None = None  # learning rate of gate parameters and sinks (default: lr)
    gate_weight_decay: float | None = None  # their weight decay (default: 0)
    norm_weight_decay: float = 0.0  # on LayerNorm/RMSNorm gamma (Bondarenko's --wd_LN_gamma); biases: 0
    max_grad_norm: float = 1.0
    data: str = "train"  # a text source, or "backcopy[:key=value,...]" (synthetic sink-inducing task)
    eval_data: str | None = "validation"
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end)
    eval_batches: int = 4
    observe_every: int = 0  # steps between light observe passes (0: only at the end)
    checkpoint_every: int = 0
    log_every: int = 10
    seed: int = 0
    mixed_precision: str = "auto"  # auto (bf16 on GPU, none on CPU) | no | bf16 | fp16
    log_with: str | None = None  # also log to this accelerate tracker: "tensorboard" (into out/tensorboard/)
    out: str | None = None
    resume: bool = False
    overwrite: bool = False  # remove an earlier run's files from out first (else a run there is refused)
    extra: dict = field(default_factory=dict)  # free-form, recorded in trainer.json

    def check(self, name: Callable[[str], str] = str) -> TrainConfig:
        """This config, where every setting is in its range (:data:`TRAIN_RANGES`, which a study file's
        ``train:`` is checked against too); else a one-line ValueError naming the first that is not, as
        ``name`` spells it for the caller's user (``--steps`` on the command line)."""
        for key, valid in TRAIN_RANGES.items():
            check_range(name(key), getattr(self, key), valid)
        if self.resume and self.overwrite:
            raise ValueError(
                f"{name('resume')} continues the run in {name('out')} and {name('overwrite')} removes it: give one"
            )
        return self

    def resolved(self, family: str) -> TrainConfig:
        self.check()
        unset = [k for k in ("lr", "betas", "weight_decay", "schedule") if getattr(self, k) is None]
        if family not in FAMILY_DEFAULTS and unset:
            raise ValueError(
                f"family {family!r} has no training recipe in FAMILY_DEFAULTS: give {', '.join(unset)} "
                f"(or add the family's recipe to quantgate.train.FAMILY_DEFAULTS)"
            )
        d = FAMILY_DEFAULTS.get(family, OPT_RECIPE)  # every value comes from self where the family has none
        c = TrainConfig(**asdict(self))
        c.lr = self.lr if self.lr is not None else d["lr"]
        # a list where the config came from JSON or YAML: tuple() keeps its two values
        c.betas = cast(tuple[float, float], tuple(self.betas)) if self.betas is not None else d["betas"]
        c.weight_decay = self.weight_decay if self.weight_decay is not None else d["weight_decay"]
        c.schedule = self.schedule or d["schedule"]
        if c.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown schedule {c.schedule!r}; valid: cosine, linear, constant")
        return c


# The values each TrainConfig setting accepts, the one definition that TrainConfig.check (the Python API and
# the command line) and a study file's schema (quantgate.study.schema) check against; None passes (a default).
TRAIN_RANGES: dict[str, Range] = {
    "steps": AT_LEAST_1,
    "stop_after": AT_LEAST_1,
    "batch_size": AT_LEAST_1,
    "seq_len": AT_LEAST_1,
    "grad_accum": AT_LEAST_1,
    "eval_batches": AT_LEAST_1,
    "log_every": AT_LEAST_1,
    "eval_every": AT_LEAST_0,
    "observe_every": AT_LEAST_0,
    "checkpoint_every": AT_LEAST_0,
    "seed": AT_LEAST_0,
    "lr": ABOVE_0,
    "gate_lr": ABOVE_0,
    "max_grad_norm": ABOVE_0,
    "warmup": AT_LEAST_0,
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "weight_decay": AT_LEAST_0,
    "gate_weight_decay": AT_LEAST_0,
    "norm_weight_decay": AT_LEAST_0,
    "betas": (lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "each in [0, 1)"),
}


# Settings a resumed run may change: when this invocation stops, what it evaluates, observes and logs,
# how often it checkpoints. Every other field (steps, batch_size, seq_len, grad_accum, lr and the
# schedule, optimizer settings, data, seed, mixed_precision) changes the data stream or the updates, so
# the resumed run would match neither the saved config nor the new one: resume refuses them, and a
# change in the number of processes (the global batch is per-process batch_size x processes).
FREE_ON_RESUME = frozenset(
    {
        "stop_after",
        "eval_data",
        "eval_every",
        "eval_batches",
        "observe_every",
        "checkpoint_every",
        "log_every",
        "log_with",
        "out",
        "resume",
        "overwrite",
        "extra",
    }
)
CHECKPOINT_FORMAT = 1  # trainer.json "format"; earlier checkpoints were accelerate's pickles and are not loaded
MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE = "model.safetensors", "optimizer.safetensors", "trainer.json"
LOG_FILE = "log.jsonl"

Batch = dict[str, torch.Tensor]  # one micro-batch: input_ids, attention_mask, labels, (rows, seq_len)


class _Checkpointable(Protocol):
    """Data a checkpointed run can resume (:func:`_check_checkpointable` makes sure it has both)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the last finite weights were saved (see :func:`train`)."""


def make_data(
    config: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    objective: str,
    world: int = 1,
    source: str | None = None,
    shuffle: bool = True,
    epochs: int | None = None,
    seed: int | None = None,
) -> Resumable:
    """Global micro-batches (``batch_size x world`` rows) from ``config.data`` (or ``source``)."""
    source = source or config.data
    seed = config.seed if seed is None else seed
    return text_batches(
        tokenizer,
        source,
        config.seq_len,
        config.batch_size * world,
        objective,
        seed=seed,
        shuffle=shuffle,
        epochs=epochs,
    )


def param_groups(model: nn.Module, c: TrainConfig) -> list[dict]:
    """AdamW's parameter groups for ``model`` under ``c``: gates, norm gains, biases (no decay), the rest."""
    gates = {id(p) for p in gate_parameters(model).values()}
    norms = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    groups: dict[str, list[nn.Parameter]] = {"gate": [], "norm": [], "no_decay": [], "decay": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in gates:
            groups["gate"].append(p)
        elif id(p) in norms and name.endswith("weight"):
            groups["norm"].append(p)
        elif name.endswith("bias") or p.dim() < 2:
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    return [
        g
        for g in (
            {"params": groups["decay"], "weight_decay": c.weight_decay, "lr": c.lr},
            {"params": groups["no_decay"], "weight_decay": 0.0, "lr": c.lr},
            {"params": groups["norm"], "weight_decay": c.norm_weight_decay, "lr": c.lr},
            {"params": groups["gate"], "weight_decay": c.gate_weight_decay or 0.0, "lr": c.gate_lr or c.lr},
        )
        if g["params"]
    ]


def _schedule(c: TrainConfig) -> Callable[[int], float]:
    warmup = int(c.warmup * c.steps) if c.warmup < 1 else int(c.warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, c.steps - warmup))
        if c.schedule == "constant":
            return 1.0
        if c.schedule == "linear":
            return 1.0 - (1.0 - c.min_lr_ratio) * progress
        return c.min_lr_ratio + (1.0 - c.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _identity(model: nn.Module) -> dict:
    """What a checkpoint must match to be resumed: family, variant, parameter names and shapes."""
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    return {
        "family": family_of(model).name,
        "variant": str(variant_of(model)),
        "parameters": len(shapes),
        "shapes_sha": _sha(json.dumps(shapes, sort_keys=True)),
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Run:
    """The training state a checkpoint saves and a resume restores (with each process's RNG states)."""

    acc: Accelerator
    model: nn.Module  # unwrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Iterable[Batch]  # global micro-batches; resumable (_Checkpointable) where the run checkpoints
    step: int = 0
    tokens: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the weights and optimizer state are split across the processes (FSDP)."""
        return self.acc.distributed_type == DistributedType.FSDP

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside accelerate's wrapper."""
        return cast(torch.optim.Optimizer, getattr(self.optimizer, "optimizer", self.optimizer))

    def parameter_names(self) -> list[str]:
        """The name of each optimizer parameter, in the optimizer's order (optimizer.safetensors' indices)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]


WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole onto the main process's CPU


def train(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: Iterable[Batch] | None = None,
    config: TrainConfig | None = None,
) -> nn.Module:
    """Train ``model`` and return it (unwrapped). ``data`` yields global micro-batches; by default
    ``config.data`` through :func:`make_data`. With ``config.out``, logs, checkpoints, the final
    model and a plot of outlier emergence are written there (layout: the module docstring), while the
    main process holds the directory's lock (:class:`~quantgate.runlock.RunDirectoryBusy` if another
    run holds it).

    Divergence is caught before the step's update can spoil the weights: a non-finite loss before the
    backward pass, a non-finite gradient norm before the optimizer step (except under fp16 loss scaling,
    whose scaler skips such steps itself). The model then still holds the weights of the last completed
    step, a state the run really had; when they are all finite they are written to ``last-good-model``
    (no per-step copy is kept: a model that was never finite, or an update that overflowed with a finite
    gradient, leaves none, and the message says so). Then :class:`TrainingDiverged` is raised."""
    c = (config or TrainConfig()).resolved(family_of(model).name)
    _check_float(model)
    model_config = config_of(model)
    family_of(model).check_seq_len(model_config, c.seq_len)
    if variant_of(model) is None:
        apply_variant(model)
    if is_backcopy(c.data):  # quantgate_backcopy then scores the model on held-out data of its own task
        model_config.quantgate["task"] = c.data
    mp = c.mixed_precision if c.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    out = Path(c.out) if c.out else None
    _check_tracker(c.log_with, out)
    acc = Accelerator(
        gradient_accumulation_steps=c.grad_accum,
        mixed_precision=mp,
        cpu=not torch.cuda.is_available(),
        log_with=c.log_with,
        project_dir=out,
    )
    with run_lock(out) if out is not None and acc.is_main_process else contextlib.nullcontext():
        try:
            return _train(acc, model, tokenizer, data, c, out)
        finally:  # the tracker's events so far are flushed, also when the run stops on an error
            if c.log_with is not None:
                acc.end_training()


def _check_float(model: nn.Module) -> None:
    """Refuse a quantized model: its weights are rounded to a grid (or stored as integers) and its record
    names a calibration that training would make untrue."""
    record = quantization_of(model)
    if record is not None:
        source = record.get("source_model")
        raise ValueError(
            f"this model is quantized ({record['scheme']}); training would update rounded weights and keep a "
            f"quantization record that no longer describes them: train the float model"
            f"{f' it was made from ({source})' if source else ''} and quantize the result"
        )


TRACKERS = {"tensorboard": is_tensorboard_available}  # the accelerate trackers a run can log to


def _check_tracker(log_with: str | None, out: Path | None) -> None:
    if log_with is None:
        return
    if log_with not in TRACKERS:
        raise ValueError(f"unknown log_with {log_with!r}; valid: {', '.join(TRACKERS)}")
    if out is None:
        raise ValueError(f"log_with={log_with} writes into the run directory: give out (--out)")
    if not TRACKERS[log_with]():
        raise ValueError(f"log_with={log_with} needs the {log_with} package: pip install {log_with}")


def _train(
    acc: Accelerator,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: Iterable[Batch] | None,
    c: TrainConfig,
    out: Path | None,
) -> nn.Module:
    family = family_of(model)
    set_seed(c.seed)
    world, rank = acc.num_processes, acc.process_index
    data = data if data is not None else make_data(c, tokenizer, family.objective, world)
    if out is not None and (c.checkpoint_every or c.stop_after or c.resume):
        _check_checkpointable(acc, data)
    if out is not None and not c.resume:
        _check_fresh(acc, out, c.overwrite, getattr(config_of(model), "_name_or_path", ""))
    if out is not None and acc.is_main_process:
        _remove_leftovers(out)
    identity = _identity(model)
    assert c.lr is not None and c.betas is not None, "train() passes the config resolved()"
    opt = torch.optim.AdamW(param_groups(model, c), lr=c.lr, betas=c.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(c))
    model, opt = acc.prepare(model, opt)  # the schedule steps once per optimizer step, on every process
    raw = acc.unwrap_model(model)
    run = _Run(acc, raw, opt, sched, data)
    if c.resume:
        _resume(run, out, identity, c)
    eval_data = _eval_batches(c, tokenizer, family.objective) if c.eval_data else None
    logger = _JsonLog(
        out / LOG_FILE if out and acc.is_main_process else None,
        keep_until=run.step if c.resume else None,
        tracker=acc if c.log_with is not None else None,
    )
    if c.log_with is not None:
        acc.init_trackers("tensorboard", config=_hyperparameters(c))
    if not c.resume:
        logger.write({"event": "config", "config": asdict(c), "identity": identity, "world_size": world})
    model.train()
    it = iter(data)
    # one process computes the MLM loss at the masked positions only; a DDP or FSDP wrapper must see the forward call
    mlm_single = world == 1 and family.objective == "mlm" and not run.sharded
    with tqdm(total=c.steps, initial=run.step, desc="train", disable=not acc.is_main_process) as bar:
        t_last, tok_last = time.perf_counter(), run.tokens
        stop = min(c.steps, c.stop_after or c.steps)
        while run.step < stop:
            loss_sum = 0.0
            for _ in range(c.grad_accum):
                batch = _shard(next(it), rank, world, acc.device)
                with acc.accumulate(model):
                    loss = family.masked_lm_loss(raw, batch) if mlm_single else model(**batch).loss
                    if not _finite_everywhere(acc, loss):
                        _diverged(
                            run,
                            out,
                            f"the loss became non-finite at step {run.step + 1}{_first_nonfinite_block(raw, batch)}",
                        )
                    acc.backward(loss)
                    grad_norm = None
                    if acc.sync_gradients:
                        grad_norm = acc.clip_grad_norm_(model.parameters(), c.max_grad_norm)
                        if acc.scaler is None and not torch.isfinite(grad_norm):
                            _diverged(
                                run,
                                out,
                                f"the gradient norm became non-finite at step {run.step + 1} (its "
                                f"loss was finite: the backward pass overflowed)",
                            )
                    opt.step()  # accelerate skips it until the last micro-step of the accumulation
                    if acc.sync_gradients:
                        sched.step()
                    opt.zero_grad(set_to_none=True)
                loss_sum += float(loss.detach())
                run.tokens += int(batch["attention_mask"].sum()) * world
            run.step += 1
            bar.update(1)
            step = run.step
            if step % c.log_every == 0 or step == c.steps:
                now = time.perf_counter()
                rate = (run.tokens - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, run.tokens
                record = {
                    "event": "train",
                    "step": step,
                    "loss": loss_sum / c.grad_accum,
                    "lr": sched.get_last_lr()[0],
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tokens": run.tokens,
                    "tokens_per_s": rate,
                }
                logger.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:,.0f}")
            if eval_data is not None and ((c.eval_every and step % c.eval_every == 0) or step == c.steps):
                logger.write({"event": "eval", "step": step, "loss": _eval_loss(raw, eval_data, acc.device)})
            if eval_data is not None and ((c.observe_every and step % c.observe_every == 0) or step == c.steps):
                logger.write({"event": "observe", "step": step, **_light_observe(raw, eval_data[:1])})
            if out is not None and ((c.checkpoint_every and step % c.checkpoint_every == 0) or step == stop < c.steps):
                _checkpoint(run, out / "checkpoints" / f"step-{step}", identity, c)
    acc.wait_for_everyone()
    if out is not None and run.step == c.steps:
        weights = _gathered(run)
        if acc.is_main_process:
            _save_model(raw, out / "model", tokenizer, weights)
            plot_training(out / LOG_FILE, out / "training.png")
    # without accelerate's mixed-precision wrapper: what the caller observes, quantizes or evaluates next
    # runs in the model's own dtype, not silently in bf16 autocast. Under FSDP it is each process's shard
    # (a forward pass needs every process); the whole weights are in out/model
    return acc.unwrap_model(model, keep_fp32_wrapper=False)


def _finite_everywhere(acc: Accelerator, loss: torch.Tensor) -> bool:
    """Whether every process's ``loss`` is finite, so that all stop together (one alone would leave the others
    waiting in the backward pass's collectives)."""
    return bool(torch.isfinite(acc.gather(loss.detach().reshape(1))).all())


def _gathered(run: _Run) -> dict[str, torch.Tensor] | None:
    """Under FSDP, the weights gathered whole onto the main process (every process must call this; the others
    get an empty dict); None where each process holds them whole already."""
    return _whole_weights(run) if run.sharded else None


def _whole_weights(run: _Run) -> dict[str, torch.Tensor]:
    """The model's weights, whole, on the main process (empty on the others), tied weights once. Every process
    must call this: under FSDP it gathers the shards."""
    state = cast(dict[str, torch.Tensor], get_model_state_dict(run.model, options=WHOLE))  # whole: plain tensors
    first: dict[int, str] = {}  # each parameter's first name; a later one is a tied weight's alias
    tied = {n for n, p in run.model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}
    return {k: t for k, t in state.items() if k not in tied} if run.acc.is_main_process else {}


RUN_FILES = (LOG_FILE, "model", "last-good-model", "training.png", "tensorboard")  # beside checkpoints/


def _check_fresh(acc: Accelerator, out: Path, overwrite: bool, source: str) -> None:
    """A run that does not resume starts where no other run's files are: its model/ and log would describe
    it while the checkpoints there (which a later resume continues) describe the other. ``overwrite``
    removes them first, unless the model trained was loaded from among them (``source``, e.g. the
    last-good-model of a diverged run); without it they are refused, naming them."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if can_resume(out):
        found.append("checkpoints")
    if not found:
        return
    if not overwrite:
        raise ValueError(
            f"{out} holds another training run ({', '.join(found)}): continue it with resume=True (--resume), "
            f"start afresh with overwrite=True (--overwrite, which removes them), or give another out (--out)"
        )
    inside = [
        name
        for name in [*found, "checkpoints"]
        if source and Path(source).resolve().is_relative_to((out / name).resolve())
    ]
    if inside:
        raise ValueError(
            f"overwrite would remove {out / inside[0]}, which holds the model being trained ({source}): "
            f"train into another out (--out)"
        )
    acc.wait_for_everyone()  # every process has looked before the main one removes
    if acc.is_main_process:
        log.warning("removing the earlier run in %s (overwrite): %s", out, ", ".join(found))
        for name in [*found, "checkpoints"]:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    acc.wait_for_everyone()


def _shard(batch: dict, rank: int, world: int, device) -> dict:
    """This process's rows of a global micro-batch, on its device."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise ValueError(f"a global batch of {n} rows does not split over {world} processes")
    part = n // world
    return {k: v[rank * part : (rank + 1) * part].to(device) for k, v in batch.items()}


def _eval_batches(c: TrainConfig, tokenizer: PreTrainedTokenizerBase, objective: str) -> list[Batch]:
    source = c.data if is_backcopy(c.data) and c.eval_data == "validation" else c.eval_data
    data = make_data(c, tokenizer, objective, source=source, shuffle=False, epochs=1, seed=c.seed + 1)
    return list(itertools.islice(data, c.eval_batches))


@torch.no_grad()
def _eval_loss(model: nn.Module, data: list[Batch], device: torch.device) -> float:
    with eval_mode(model):
        return sum(float(model(**{k: v.to(device) for k, v in b.items()}).loss) for b in data) / len(data)


def _light_observe(model: nn.Module, data: list[Batch]) -> dict:
    """Per layer: residual max |x|, mean kurtosis, first-token attention, gate mean."""
    report = observe(model, data, progress=False)
    return {
        "layers": [
            {
                "max_abs": L["max_activation"],
                "kurtosis": L["kurtosis"],
                "sink_mass": L["sink_mass"],
                "gate_mean": L["gate_mean"],
            }
            for L in report.layers
        ],
        **{k: report.summary[k] for k in ("max_activation", "max_median_ratio", "kurtosis", "sink_mass", "gate_mean")},
    }


def _check_checkpointable(acc: Accelerator, data: Iterable[Batch]) -> None:
    """Before any work: refuse checkpoints this trainer cannot write or resume correctly."""
    if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"checkpoints (checkpoint_every, stop_after, resume) are not supported under "
            f"{acc.distributed_type.value}: its sharded state has no pickle-free format here; use "
            f"DDP or FSDP version 2 (accelerate configs), or train without checkpoints"
        )
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise ValueError(
            "checkpoints (checkpoint_every, stop_after, resume) need FSDP version 2 (fsdp_version: 2 in the "
            "accelerate config): version 1's flattened parameters do not map to the checkpoint's per-parameter "
            "optimizer state"
        )
    if not (hasattr(data, "state_dict") and hasattr(data, "load_state_dict")):
        raise ValueError(
            f"checkpoints (checkpoint_every, stop_after, resume) need data that can resume: "
            f"{type(data).__name__} has no state_dict/load_state_dict; pass quantgate.data.batches "
            f"(or an object with both), or train without checkpoints"
        )


def _checkpoint(run: _Run, path: Path, identity: dict, c: TrainConfig) -> None:
    """Write checkpoint ``path`` (layout: the module docstring) into a temporary folder, then rename it.
    Under DDP the weights and optimizer state are the same on every process, under FSDP they are gathered
    whole from the shards: the main process writes them; each process writes its RNG states. A full or
    read-only disk is a one-line ValueError; the checkpoints written before stay, and the run continues from
    the newest with resume."""
    try:
        _write_checkpoint(run, path, identity, c)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(temporary_folder(path), ignore_errors=True)
        kept = sorted(p.name for p in path.parent.glob("step-*") if p.is_dir())
        raise ValueError(
            f"cannot write the checkpoint {path}: {write_failure(e)}; "
            + (f"the earlier ones are kept ({', '.join(kept)}): " if kept else "")
            + "free space (or choose a writable --out) and continue with --resume"
        ) from None


def _write_checkpoint(run: _Run, path: Path, identity: dict, c: TrainConfig) -> None:
    acc = run.acc
    tmp = temporary_folder(path)
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    _save_rng(tmp / f"rng-{acc.process_index}.safetensors")
    weights = _whole_weights(run)  # under FSDP every process takes part in gathering both
    moments = get_optimizer_state_dict(run.model, run.inner_optimizer, options=WHOLE)
    if acc.is_main_process:
        save_file({k: t.detach().contiguous() for k, t in weights.items()}, str(tmp / MODEL_FILE))
        index = {name: i for i, name in enumerate(run.parameter_names())}
        save_file(
            {
                f"{index[p]}.{name}": t.contiguous()
                for p, state in cast(dict[str, dict[str, torch.Tensor]], moments["state"]).items()
                for name, t in state.items()
            },
            str(tmp / OPTIMIZER_FILE),
        )
        opt = run.optimizer.state_dict()
        trainer = {
            "format": CHECKPOINT_FORMAT,
            "identity": identity,
            "config": asdict(c),
            "world_size": acc.num_processes,
            "model_config": _model_settings(run.model),
            "progress": {"step": run.step, "tokens": run.tokens},
            "optimizer": {"param_groups": opt["param_groups"]},
            "scheduler": run.scheduler.state_dict(),
            "data": cast(_Checkpointable, run.data).state_dict(),  # checked by _check_checkpointable
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        }
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer, indent=1))
    acc.wait_for_everyone()
    if acc.is_main_process:
        publish_folder(tmp, path)


def _resume(run: _Run, out: Path | None, identity: dict, c: TrainConfig) -> None:
    """Restore ``run`` from the newest complete checkpoint of the same model and settings."""
    path, saved = _newest_checkpoint(out)
    if saved["identity"] != identity:
        s = saved["identity"]
        raise ValueError(
            f"{path} belongs to another model ({s['family']}, variant {s['variant']}, "
            f"{s['parameters']} tensors) than this one ({identity['family']}, variant "
            f"{identity['variant']}, {identity['parameters']} tensors); resume with the same model and "
            f"variant, or train into a new directory"
        )
    now = json.loads(json.dumps(asdict(c)))  # as trainer.json holds it (tuples as lists)
    changed = [
        f"{k} {saved['config'].get(k)!r} -> {v!r}"
        for k, v in now.items()
        if k not in FREE_ON_RESUME and saved["config"].get(k) != v
    ]
    if saved["world_size"] != run.acc.num_processes:
        changed.append(f"processes {saved['world_size']} -> {run.acc.num_processes}")
    if changed:
        raise ValueError(
            f"cannot resume {path} with changed settings: {', '.join(changed)}. They change the data "
            f"or the updates, so the run would match neither config; resume with the saved values, "
            f"or train into a new --out"
        )
    _check_model_settings(run.model, path, saved)
    step = saved["progress"]["step"]
    if c.stop_after is not None and c.stop_after <= step:
        raise ValueError(
            f"stop_after {c.stop_after}: {path} is at step {step} already; give a later stop_after "
            f"(--stop-after) or none (to the end, step {c.steps})"
        )
    _check_optimizer(run, path, saved, c)
    _load_checkpoint(run, path, saved)
    log.info("resumed from %s", path)


UNRECORDED = frozenset(
    {"transformers_version", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "use_cache"}
)  # model config fields that do not change what the model computes (trainer.json leaves them out)


def _model_settings(model: nn.Module) -> dict:
    """The model's config as trainer.json records it (as JSON reads it back), less :data:`UNRECORDED`."""
    config = config_of(model).to_dict()
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in UNRECORDED}, default=str))


def _check_model_settings(model: nn.Module, path: Path, saved: dict) -> None:
    """Refuse to resume a checkpoint with a model whose config differs from the one it was trained with, even
    where the tensor shapes agree (an activation, a norm's eps): one run would mix two architectures."""
    if "model_config" not in saved:
        log.warning("%s records no model config (an older quantgate wrote it): resuming without checking it", path)
        return
    was, now = saved["model_config"], _model_settings(model)
    changed = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if changed:
        raise ValueError(
            f"cannot resume {path}: the model's config changed: {', '.join(changed)}. Its weights were trained "
            f"with the saved values: resume with the same model and --config, or train into a new --out"
        )


def _check_optimizer(run: _Run, path: Path, saved: dict, c: TrainConfig) -> None:
    """The optimizer's and the schedule's saved hyperparameters are the ones this config makes (the learning
    rate: the schedule's at the saved step), so that a resumed run continues the run its config describes."""
    file = path / TRAINER_FILE
    step = saved["progress"]["step"]
    fresh = json.loads(json.dumps(run.optimizer.state_dict()["param_groups"]))
    groups = saved["optimizer"]["param_groups"]
    if len(groups) != len(fresh):
        raise ValueError(
            f"{file}: optimizer.param_groups holds {len(groups)} groups, but this model and config make "
            f"{len(fresh)}; resume the run it belongs to, or train into a new --out"
        )
    factor = _schedule(c)(step)
    for i, (got, want) in enumerate(zip(groups, fresh, strict=True)):
        for key in sorted(set(got) | set(want)):
            value = got.get(key)
            if key == "lr":
                expected = want["initial_lr"] * factor
                same = _close(value, expected)
            else:
                expected, same = want.get(key), value == want.get(key)
            if not same:
                raise ValueError(
                    f"{file}: optimizer.param_groups[{i}].{key} is {_short(value)}, but the run's config makes it "
                    f"{_short(expected)} at step {step}; the file was edited or belongs to another run: resume "
                    f"an unedited checkpoint, or train into a new --out"
                )
    lrs = [g["initial_lr"] * factor for g in fresh]
    expected_sched = {**run.scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1}
    for key in sorted(set(saved["scheduler"]) | set(expected_sched)):
        value, want = saved["scheduler"].get(key), expected_sched.get(key)
        if key == "_last_lr":
            same = isinstance(value, list) and len(value) == len(lrs) and all(map(_close, value, lrs))
            want = lrs
        else:
            same = value == json.loads(json.dumps(want))
        if not same:
            raise ValueError(
                f"{file}: scheduler.{key} is {_short(value)}, but the run's config makes it {_short(want)} at "
                f"step {step}; the file was edited or belongs to another run: resume an unedited checkpoint, or "
                f"train into a new --out"
            )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _close(a: object, b: float) -> bool:
    return _number(a) and math.isclose(cast(float, a), b, rel_tol=1e-9)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value read from a file can be of any size)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def can_resume(out: str | Path) -> bool:
    """Whether run directory ``out`` holds a complete checkpoint that ``resume=True`` would continue from."""
    try:
        _newest_checkpoint(Path(out))
        return True
    except FileNotFoundError:
        return False


def _newest_checkpoint(out: Path | None) -> tuple[Path, dict]:
    """The newest complete ``checkpoints/step-N`` and its trainer.json; incomplete ones are skipped with a warning."""
    found = (
        [(int(m[1]), p) for p in (out / "checkpoints").glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
        if out
        else []
    )
    skipped = []
    for _, path in sorted(found, reverse=True):
        try:
            return path, _read_trainer(path)
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            skipped.append(f"{path.name}: {e}")
    raise FileNotFoundError(
        f"nothing to resume: no complete checkpoint under {out}/checkpoints (train with "
        f"checkpoint_every > 0 first, or drop --resume)" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
    )


TRAINER_LIMIT = 64 << 20  # bytes: the most of a trainer.json read (a run's is a few kB)
_MISSING = object()

# trainer.json's fields: (JSON type, range or None); each is checked before a resume uses it
TRAINER_FIELDS: dict[str, tuple[type | tuple[type, ...], Range | None]] = {
    "identity": (dict, None),
    "identity.family": (str, None),
    "identity.variant": (str, None),
    "identity.parameters": (int, AT_LEAST_0),
    "identity.shapes_sha": (str, None),
    "config": (dict, None),
    "world_size": (int, AT_LEAST_1),
    "progress": (dict, None),
    "progress.step": (int, AT_LEAST_0),
    "progress.tokens": (int, AT_LEAST_0),
    "optimizer": (dict, None),
    "optimizer.param_groups": (list, (lambda gs: all(isinstance(g, dict) for g in gs), "a list of objects")),
    "scheduler": (dict, None),
    "data": (dict, None),
    "scaler": ((dict, type(None)), None),
}


def _read_trainer(path: Path) -> dict:
    """trainer.json of checkpoint ``path``, every field a resume reads checked (:data:`TRAINER_FIELDS`);
    ValueError saying why ``path`` is not a complete checkpoint, naming the file and field."""
    file = path / TRAINER_FILE
    if not file.is_file():
        raise ValueError(f"it has no {TRAINER_FILE} (its write was interrupted)")
    saved = read_json(file, limit=TRAINER_LIMIT)
    if saved.get("format") != CHECKPOINT_FORMAT:
        raise ValueError("it is in an older format (accelerate's pickled state), which quantgate does not load")
    for name, (kind, valid) in TRAINER_FIELDS.items():
        value: object = saved
        for part in name.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            raise ValueError(f"{file} lacks {name}")
        exact = not isinstance(value, bool) or kind is bool
        if not (exact and isinstance(value, kind) and in_range(value, valid)):
            wants = " or ".join(json_kind(t()) for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(
                f"{file}: {name} must be a JSON {wants}{f', {valid[1]}' if valid else ''}; got {_short(value)}"
            )
    if "model_config" in saved and not isinstance(saved["model_config"], dict):
        raise ValueError(f"{file}: model_config must be a JSON object; got {_short(saved['model_config'])}")
    missing = [f for f in (MODEL_FILE, OPTIMIZER_FILE) if not (path / f).is_file()]
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}")
    world = saved["world_size"]
    ranks = {p.name for p in path.glob("rng-*.safetensors")}
    if world > len(ranks) or not all(f"rng-{r}.safetensors" in ranks for r in range(world)):
        raise ValueError(
            f"{file}: world_size is {world}, but the checkpoint holds the RNG states of "
            f"{sum(f'rng-{r}.safetensors' in ranks for r in range(min(world, len(ranks))))} processes "
            f"(rng-<rank>.safetensors, one per process)"
        )
    return saved


OPTIMIZER_STATES = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})  # AdamW's, per parameter


def _load_checkpoint(run: _Run, path: Path, saved: dict) -> None:
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
            raise ValueError(
                f"{file}: tensor {key!r} is not '<parameter index>.<AdamW state>' of this model's optimizer"
            )
        want = (1,) if name == "step" else tuple(params[i].shape)
        if ((t.numel(),) if name == "step" else tuple(t.shape)) != want:
            raise ValueError(f"{file}: tensor {key!r} has shape {list(t.shape)}; its parameter needs {list(want)}")
        state.setdefault(i, {})[name] = t
    names = run.parameter_names()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved["optimizer"]["param_groups"]]
    set_optimizer_state_dict(
        run.model,
        run.inner_optimizer,
        {"state": {names[i]: s for i, s in state.items()}, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
    run.scheduler.load_state_dict(saved["scheduler"])
    if isinstance(run.data, Resumable):
        for key in ("epoch", "batch"):
            value = saved["data"].get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{path / TRAINER_FILE}: data.{key} must be an integer >= 0; got {_short(value)}")
    cast(_Checkpointable, run.data).load_state_dict(saved["data"])  # checked by _check_checkpointable
    if run.acc.scaler is not None:
        if saved["scaler"] is None:
            raise ValueError(f"{path / TRAINER_FILE}: scaler is null, but this run scales its fp16 loss")
        run.acc.scaler.load_state_dict(saved["scaler"])
    run.step, run.tokens = saved["progress"]["step"], saved["progress"]["tokens"]
    _load_rng(path / f"rng-{run.acc.process_index}.safetensors")


def _save_rng(file: Path) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    # the legacy global generator's state is always the (MT19937, key, pos, has_gauss, gauss) tuple
    _, key, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    save_file(
        tensors,
        str(file),
        metadata={"python": json.dumps(random.getstate()), "numpy": json.dumps([key.tolist(), pos, has_gauss, gauss])},
    )


def _load_rng(file: Path) -> None:
    """Restore this process's generators from ``file``; ValueError naming it where its states do not load."""
    try:
        _set_rng(file)
    except (KeyError, ValueError, TypeError, RuntimeError, OverflowError) as e:  # an edited or foreign file
        raise ValueError(
            f"{file}: not the RNG states this trainer saves ({type(e).__name__}: {_short(str(e))})"
        ) from None


def _set_rng(file: Path) -> None:
    with safe_open(str(file), framework="pt") as fh:
        meta = fh.metadata()
        torch.set_rng_state(fh.get_tensor("torch"))
        cuda = sorted((k for k in fh.keys() if k.startswith("cuda.")), key=lambda k: int(k[5:]))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([fh.get_tensor(k) for k in cuda])
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    key, pos, has_gauss, gauss = json.loads(meta["numpy"])
    np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has_gauss, gauss))


def _diverged(run: _Run, out: Path | None, what: str) -> NoReturn:
    """Stop: ``what`` happened before this step's update, so the model holds the last completed step's
    weights; write them to ``out/last-good-model`` when all are finite (see :func:`train`)."""
    saved = ""
    weights = _gathered(run) if out is not None else None  # every process stops here together
    if out is not None and run.acc.is_main_process:
        if all(bool(torch.isfinite(t).all()) for t in (weights.values() if weights else run.model.parameters())):
            _save_model(run.model, out / "last-good-model", weights=weights)
            saved = (
                f"; the last finite weights (after step {run.step}) are in {out}/last-good-model, to "
                f"continue from with --model"
            )
        else:
            saved = f"; the weights were already non-finite, so no last-good-model was written (see {out}/checkpoints)"
    raise TrainingDiverged(f"{what}{saved}. Lower the learning rate or use bf16/fp32")


def _save_model(
    model: nn.Module,
    path: Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model`` (with ``weights``, its weights gathered whole, where it holds only a shard) to ``path``."""
    tmp = temporary_folder(path)
    shutil.rmtree(tmp, ignore_errors=True)
    save(model, tmp, tokenizer, weights=weights)
    publish_folder(tmp, path)


def _remove_leftovers(out: Path) -> None:
    """Remove the temporary folders of writes that an earlier run did not finish."""
    pattern = temporary_folder(Path("*")).name  # .*.tmp
    for tmp in [*out.glob(pattern), *(out / "checkpoints").glob(pattern)]:
        log.warning("removing %s: an interrupted write of %s", tmp, tmp.name[1:-4])
        shutil.rmtree(tmp)


@torch.no_grad()
def _first_nonfinite_block(model: nn.Module, batch: dict) -> str:
    family = family_of(model)
    found = []
    hooks = [
        block.register_forward_hook(
            lambda m, a, o, i=i: (
                found.append(i) if not torch.isfinite(o[0] if isinstance(o, tuple) else o).all() else None
            )
        )
        for i, block in enumerate(family.blocks(model))
    ]
    try:
        model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return (
        f"; the first non-finite activation is the output of layer {found[0]}"
        if found
        else "; every layer's output is finite (the loss itself overflowed)"
    )


class _JsonLog:
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


def _hyperparameters(c: TrainConfig) -> dict[str, bool | int | float | str]:
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
