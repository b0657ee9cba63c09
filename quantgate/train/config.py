"""What a training run is told: :class:`TrainConfig` (whose unset optimiser settings take the family's recipe,
``Family.recipe``), the ranges every setting is checked against (:data:`TRAIN_RANGES`), the settings a
resume may change (:data:`FREE_ON_RESUME`), and what a config makes: its data (:func:`make_data`), AdamW's
parameter groups (:func:`param_groups`) and the learning-rate schedule (:func:`schedule`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from ..data import batches as text_batches
from ..data.batches import Resumable
from ..errors import InputError
from ..models.families import FAMILIES, OPT_RECIPE, is_norm
from ..models.swap import gate_parameters
from ..options import ABOVE_0, AT_LEAST_0, AT_LEAST_1, SEED, Range, check_range


@dataclass
class TrainConfig:
    """What to train for and how. ``None`` fields take the family's recipe (``Family.recipe``)."""

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
            raise InputError(
                f"{name('resume')} continues the run in {name('out')} and {name('overwrite')} removes it: give one"
            )
        return self

    def resolved(self, family: str) -> TrainConfig:
        self.check()
        unset = [k for k in ("lr", "betas", "weight_decay", "schedule") if getattr(self, k) is None]
        recipe = FAMILIES[family].recipe if family in FAMILIES else None
        if recipe is None and unset:
            raise InputError(
                f"family {family!r} has no training recipe: give {', '.join(unset)} (or set the family's recipe, "
                f"Family.recipe in quantgate/models/families.py)"
            )
        d = recipe or OPT_RECIPE  # every value comes from self where the family has none
        c = TrainConfig(**asdict(self))
        c.lr = self.lr if self.lr is not None else d.lr
        # a list where the config came from JSON or YAML: tuple() keeps its two values
        c.betas = cast(tuple[float, float], tuple(self.betas)) if self.betas is not None else d.betas
        c.weight_decay = self.weight_decay if self.weight_decay is not None else d.weight_decay
        c.schedule = self.schedule or d.schedule
        if c.schedule not in ("cosine", "linear", "constant"):
            raise InputError(f"unknown schedule {c.schedule!r}; valid: cosine, linear, constant")
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
    "seed": SEED,
    "lr": ABOVE_0,
    "gate_lr": ABOVE_0,
    "max_grad_norm": ABOVE_0,
    "warmup": AT_LEAST_0,
    "min_lr_ratio": Range.between(0, 1),
    "weight_decay": AT_LEAST_0,
    "gate_weight_decay": AT_LEAST_0,
    "norm_weight_decay": AT_LEAST_0,
    "betas": Range(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "each in [0, 1)"),
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

Batch = dict[str, torch.Tensor]  # one micro-batch: input_ids, attention_mask, labels, (rows, seq_len)


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
    gate: list[nn.Parameter] = []
    norm: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in gates:
            gate.append(p)
        elif id(p) in norms and name.endswith("weight"):
            norm.append(p)
        elif name.endswith("bias") or p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    settings = (  # (parameters, weight decay, learning rate) per group
        (decay, c.weight_decay, c.lr),
        (no_decay, 0.0, c.lr),
        (norm, c.norm_weight_decay, c.lr),
        (gate, c.gate_weight_decay or 0.0, c.gate_lr or c.lr),
    )
    return [{"params": params, "weight_decay": wd, "lr": lr} for params, wd, lr in settings if params]


def schedule(c: TrainConfig) -> Callable[[int], float]:
    """The learning rate's factor at each optimizer step under ``c``: a linear warmup, then ``c.schedule``."""
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
