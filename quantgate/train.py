"""Training on HF accelerate: CLM or MLM, from scratch or from a checkpoint, resumable, with outlier,
sink and gate statistics logged as training goes.

The same code runs on a CPU, one GPU, and many (``accelerate launch``; DDP, or FSDP through an
accelerate config). Every data batch is a *global* micro-batch; each process trains on its share,
so N processes with per-device batch B see exactly what one process with batch N x B sees.

Output directory: ``log.jsonl`` (one record per logged step, eval and observe pass),
``checkpoints/step-N`` (accelerate state: safetensors weights, optimizer, scheduler, RNG, data
position; plus ``trainer.json``), ``model/`` (the final model, ``qg.save``) and ``training.png``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from .data import batches as text_batches
from .models.families import family_of
from .models.swap import gate_parameters, variant_of

__all__ = ["TrainConfig", "train", "TrainingDiverged", "FAMILY_DEFAULTS", "make_data"]

log = logging.getLogger("quantgate")

# The papers' optimiser settings per family (Bondarenko et al.: OPT lr 4e-4, AdamW(0.9, 0.95), wd 0.1;
# BERT lr 1e-4, linear decay, wd 0.01); a model family not listed uses the OPT recipe.
FAMILY_DEFAULTS = {
    "opt": dict(lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, schedule="cosine"),
    "bert": dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, schedule="linear"),
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
    data: str = "train"  # a text source, or "backcopy" (synthetic sink-inducing task)
    eval_data: str | None = "validation"
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end)
    eval_batches: int = 4
    observe_every: int = 0  # steps between light observe passes (0: only at the end)
    checkpoint_every: int = 0
    log_every: int = 10
    seed: int = 0
    mixed_precision: str = "auto"  # auto (bf16 on GPU, none on CPU) | no | bf16 | fp16
    out: str | None = None
    resume: bool = False
    extra: dict = field(default_factory=dict)  # free-form, recorded in trainer.json

    def resolved(self, family: str) -> TrainConfig:
        d = FAMILY_DEFAULTS.get(family, FAMILY_DEFAULTS["opt"])
        c = TrainConfig(**asdict(self))
        c.lr = self.lr if self.lr is not None else d["lr"]
        c.betas = tuple(self.betas) if self.betas is not None else d["betas"]
        c.weight_decay = self.weight_decay if self.weight_decay is not None else d["weight_decay"]
        c.schedule = self.schedule or d["schedule"]
        if c.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown schedule {c.schedule!r}; valid: cosine, linear, constant")
        return c


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good state was saved."""


def make_data(config: TrainConfig, tokenizer, objective: str, world: int = 1, source: str | None = None,
              shuffle: bool = True, epochs=None, seed: int | None = None):
    """Global micro-batches (``batch_size x world`` rows) from ``config.data`` (or ``source``)."""
    source = source or config.data
    seed = config.seed if seed is None else seed
    return text_batches(tokenizer, source, config.seq_len, config.batch_size * world, objective, seed=seed,
                        shuffle=shuffle, epochs=epochs)


def _param_groups(model: nn.Module, c: TrainConfig) -> list[dict]:
    gates = {id(p) for p in gate_parameters(model).values()}
    norms = {id(p) for m in model.modules() if type(m).__name__.endswith("Norm") or isinstance(m, nn.LayerNorm)
             for p in m.parameters(recurse=False)}
    groups = {"gate": [], "norm": [], "no_decay": [], "decay": []}
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
    return [g for g in (
        {"params": groups["decay"], "weight_decay": c.weight_decay, "lr": c.lr},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr": c.lr},
        {"params": groups["norm"], "weight_decay": c.norm_weight_decay, "lr": c.lr},
        {"params": groups["gate"], "weight_decay": c.gate_weight_decay or 0.0, "lr": c.gate_lr or c.lr},
    ) if g["params"]]


def _schedule(c: TrainConfig):
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
    return {"family": family_of(model).name, "variant": str(variant_of(model)), "parameters": len(shapes),
            "shapes_sha": _sha(json.dumps(shapes, sort_keys=True))}


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Progress:
    """The trainer's own state saved with each checkpoint: step and token counts."""

    def __init__(self):
        self.step = 0
        self.tokens = 0

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state):
        self.step, self.tokens = state["step"], state["tokens"]


def train(model: nn.Module, tokenizer, data=None, config: TrainConfig | None = None) -> nn.Module:
    """Train ``model`` and return it (unwrapped). ``data`` yields global micro-batches; by default
    ``config.data`` through :func:`make_data`. With ``config.out``, logs, checkpoints, the final
    model and a plot of outlier emergence are written there."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    family = family_of(model)
    c = (config or TrainConfig()).resolved(family.name)
    if variant_of(model) is None:
        from .models.swap import apply_variant

        apply_variant(model)
    mp = c.mixed_precision if c.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    acc = Accelerator(gradient_accumulation_steps=c.grad_accum, mixed_precision=mp, cpu=not torch.cuda.is_available())
    set_seed(c.seed)
    world, rank = acc.num_processes, acc.process_index
    data = data if data is not None else make_data(c, tokenizer, family.objective, world)
    out = Path(c.out) if c.out else None
    identity = _identity(model)
    opt = torch.optim.AdamW(_param_groups(model, c), lr=c.lr, betas=c.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(c))
    model, opt = acc.prepare(model, opt)  # the schedule steps once per optimizer step, on every process
    progress = _Progress()
    acc.register_for_checkpointing(sched, progress, data)
    if c.resume:
        _resume(acc, out, identity)
    raw = acc.unwrap_model(model)
    eval_data = _eval_batches(c, tokenizer, family.objective) if c.eval_data else None
    logger = _JsonLog(out / "log.jsonl" if out and acc.is_main_process else None, append=c.resume)
    if not c.resume:
        logger.write({"event": "config", "config": asdict(c), "identity": identity, "world_size": world})
    model.train()
    it = iter(data)
    bar = tqdm(total=c.steps, initial=progress.step, desc="train", disable=not acc.is_main_process)
    t_last, tok_last = time.perf_counter(), progress.tokens
    stop = min(c.steps, c.stop_after or c.steps)
    while progress.step < stop:
        loss_sum = 0.0
        for _ in range(c.grad_accum):
            batch = _shard(next(it), rank, world, acc.device)
            with acc.accumulate(model):
                loss = _masked_lm_loss(raw, batch) if world == 1 and family.objective == "mlm" else model(**batch).loss
                if not torch.isfinite(loss):
                    _diverged(acc, raw, out, progress.step, batch)
                acc.backward(loss)
                grad_norm = None
                if acc.sync_gradients:
                    grad_norm = acc.clip_grad_norm_(model.parameters(), c.max_grad_norm)
                opt.step()  # accelerate skips it until the last micro-step of the accumulation
                if acc.sync_gradients:
                    sched.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += float(loss.detach())
            progress.tokens += int(batch["attention_mask"].sum()) * world
        progress.step += 1
        bar.update(1)
        step = progress.step
        if step % c.log_every == 0 or step == c.steps:
            now = time.perf_counter()
            rate = (progress.tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, progress.tokens
            record = {"event": "train", "step": step, "loss": loss_sum / c.grad_accum, "lr": sched.get_last_lr()[0],
                      "grad_norm": float(grad_norm) if grad_norm is not None else None, "tokens": progress.tokens,
                      "tokens_per_s": rate}
            logger.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:,.0f}")
        if eval_data is not None and ((c.eval_every and step % c.eval_every == 0) or step == c.steps):
            logger.write({"event": "eval", "step": step, "loss": _eval_loss(raw, eval_data, acc.device)})
        if eval_data is not None and ((c.observe_every and step % c.observe_every == 0) or step == c.steps):
            logger.write({"event": "observe", "step": step, **_light_observe(raw, eval_data[:1])})
        if out is not None and ((c.checkpoint_every and step % c.checkpoint_every == 0) or step == stop < c.steps):
            _checkpoint(acc, out / "checkpoints" / f"step-{step}", identity, c)
    bar.close()
    acc.wait_for_everyone()
    if out is not None and acc.is_main_process and progress.step == c.steps:
        from .quant.checkpoint import save

        save(raw, out / "model", tokenizer)
        from .plots import plot_training

        plot_training(logger.path, out / "training.png")
    return raw


def _masked_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The MLM loss computing vocabulary logits only at the masked positions (~7x less work for small
    models than the head's logits at every position; the same value). Single process only: a DDP
    wrapper must see the forward call to synchronise gradients."""
    if not (hasattr(model, "bert") and hasattr(model, "cls")):
        return model(**batch).loss
    hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    picked = batch["labels"] != -100
    return nn.functional.cross_entropy(model.cls(hidden[picked]).float(), batch["labels"][picked])


def _shard(batch: dict, rank: int, world: int, device) -> dict:
    """This process's rows of a global micro-batch, on its device."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise ValueError(f"a global batch of {n} rows does not split over {world} processes")
    part = n // world
    return {k: v[rank * part:(rank + 1) * part].to(device) for k, v in batch.items()}


def _eval_batches(c: TrainConfig, tokenizer, objective: str) -> list[dict]:
    source = c.eval_data if not (c.data == "backcopy" and c.eval_data == "validation") else "backcopy"
    data = make_data(c, tokenizer, objective, source=source, shuffle=False, epochs=1, seed=c.seed + 1)
    return [b for _, b in zip(range(c.eval_batches), data)]


@torch.no_grad()
def _eval_loss(model: nn.Module, data: list[dict], device) -> float:
    was = model.training
    model.eval()
    try:
        return sum(float(model(**{k: v.to(device) for k, v in b.items()}).loss) for b in data) / len(data)
    finally:
        model.train(was)


def _light_observe(model: nn.Module, data: list[dict]) -> dict:
    """Per layer: residual max |x|, mean kurtosis, first-token attention, gate mean."""
    from .observe import observe

    report = observe(model, data, progress=False)
    return {"layers": [{"max_abs": L["max_activation"], "kurtosis": L["kurtosis"], "sink_mass": L["sink_mass"],
                        "gate_mean": L["gate_mean"]} for L in report.layers],
            **{k: report.summary[k] for k in ("max_activation", "max_median_ratio", "kurtosis", "sink_mass",
                                              "gate_mean")}}


def _checkpoint(acc, path: Path, identity: dict, c: TrainConfig) -> None:
    acc.save_state(str(path))
    if acc.is_main_process:
        (path / "trainer.json").write_text(json.dumps({"identity": identity, "config": asdict(c)}, indent=1))


def _resume(acc, out: Path | None, identity: dict) -> None:
    ckpts = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1])) if out else []
    if not ckpts:
        raise FileNotFoundError(f"nothing to resume: no checkpoints under {out}/checkpoints (train with "
                                f"checkpoint_every > 0 first, or drop --resume)")
    saved = json.loads((ckpts[-1] / "trainer.json").read_text())["identity"]
    if saved != identity:
        raise ValueError(f"{ckpts[-1]} belongs to another model ({saved['family']}, variant {saved['variant']}, "
                         f"{saved['parameters']} tensors) than this one ({identity['family']}, variant "
                         f"{identity['variant']}, {identity['parameters']} tensors); resume with the same model and "
                         f"variant, or train into a new directory")
    acc.load_state(str(ckpts[-1]))
    log.info("resumed from %s", ckpts[-1])


def _diverged(acc, model: nn.Module, out: Path | None, step: int, batch: dict):
    """Loss is NaN/inf: find the first block with a non-finite output, save the last good state, stop."""
    where = _first_nonfinite_block(model, batch)
    saved = ""
    if out is not None:
        from .quant.checkpoint import save

        acc.save_state(str(out / "checkpoints" / "last-good"))
        save(model, out / "last-good-model")
        saved = f"; the last good state (before this step's update) is in {out}/checkpoints/last-good and " \
                f"{out}/last-good-model"
    raise TrainingDiverged(f"the loss became non-finite at step {step + 1}{where}{saved}. Lower the learning rate or "
                           f"use bf16/fp32")


@torch.no_grad()
def _first_nonfinite_block(model: nn.Module, batch: dict) -> str:
    family = family_of(model)
    found = []
    hooks = [block.register_forward_hook(
        lambda m, a, o, i=i: found.append(i) if not torch.isfinite(o[0] if isinstance(o, tuple) else o).all() else None)
        for i, block in enumerate(family.blocks(model))]
    try:
        model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return f"; the first non-finite activation is the output of layer {found[0]}" if found else \
        "; every layer's output is finite (the loss itself overflowed)"


class _JsonLog:
    def __init__(self, path: Path | None, append: bool):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                path.write_text("")

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
