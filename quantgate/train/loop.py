"""The training loop: :func:`train` checks the model and settings, starts accelerate and holds the run
directory's lock; each step shards the global micro-batch, stops on divergence before the update, logs,
evaluates, observes and checkpoints; the end writes the final model."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..data.synthetic import is_backcopy
from ..errors import InputError, Unavailable
from ..models.families import config_of, family_of
from ..models.modes import eval_mode
from ..models.record import set_record
from ..models.swap import apply_variant, variant_of
from ..observe import observe
from ..quant import quantization_of
from ..runlock import run_lock
from .checkpoint import Run, check_checkpointable, gathered, model_identity, write_checkpoint
from .config import Batch, TrainConfig, make_data, param_groups, schedule
from .log import (
    LOG_FILE,
    ConfigEvent,
    EvalEvent,
    JsonLog,
    LayerPoint,
    ObserveEvent,
    TrainEvent,
    check_tracker,
    hyperparameters,
    plot_training,
    read_log,
)
from .resume import resume
from .rundir import check_fresh, claim_run_dir, remove_leftovers, save_model


class TrainingDiverged(Unavailable):
    """The loss or the gradient norm became NaN/inf; the last finite weights were saved (see :func:`train`)."""


def train(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: Iterable[Batch] | None = None,
    config: TrainConfig | None = None,
) -> nn.Module:
    """Train ``model`` and return it (unwrapped). ``data`` yields global micro-batches; by default
    ``config.data`` through :func:`make_data`. With ``config.out``, logs, checkpoints, the final
    model and a plot of outlier emergence are written there (layout: :mod:`quantgate.train.rundir`), while the
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
    if is_backcopy(c.data):  # its evaluation task then scores the model on held-out data of its own task
        set_record(model, task=c.data)
    mp = c.mixed_precision if c.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    out = Path(c.out) if c.out else None
    check_tracker(c.log_with, out)
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
        source = record.source_model
        raise InputError(
            f"this model is quantized ({record.scheme}); training would update rounded weights and keep a "
            f"quantization record that no longer describes them: train the float model"
            f"{f' it was made from ({source})' if source else ''} and quantize the result"
        )


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
    world = acc.num_processes
    data = data if data is not None else make_data(c, tokenizer, family.objective, world)
    if out is not None:
        _claim(acc, out, c, model, data)
    identity = model_identity(model)
    assert c.lr is not None and c.betas is not None, "train() passes the config resolved()"
    opt = torch.optim.AdamW(param_groups(model, c), lr=c.lr, betas=c.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(c))
    model, opt = acc.prepare(model, opt)  # the schedule steps once per optimizer step, on every process
    raw = acc.unwrap_model(model)
    run = Run(acc, raw, opt, sched, data)
    if c.resume:
        resume(run, out, identity, c)
    eval_data = _eval_batches(c, tokenizer, family.objective) if c.eval_data else None
    logger = JsonLog(
        out / LOG_FILE if out and acc.is_main_process else None,
        keep_until=run.step if c.resume else None,
        tracker=acc if c.log_with is not None else None,
    )
    if c.log_with is not None:
        acc.init_trackers("tensorboard", config=hyperparameters(c))
    if not c.resume:
        logger.write(ConfigEvent(asdict(c), identity, world))
    model.train()
    it = iter(data)
    # one process computes the MLM loss at the masked positions only; a DDP or FSDP wrapper must see the forward call
    mlm_single = world == 1 and family.objective == "mlm" and not run.sharded
    with tqdm(total=c.steps, initial=run.step, desc="train", disable=not acc.is_main_process) as bar:
        t_last, tok_last = time.perf_counter(), run.tokens
        stop = min(c.steps, c.stop_after or c.steps)
        while run.step < stop:
            loss_sum, grad_norm = _optimizer_step(run, model, it, c, out, mlm_single)
            run.step += 1
            bar.update(1)
            step = run.step
            if step % c.log_every == 0 or step == c.steps:
                now = time.perf_counter()
                rate = (run.tokens - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, run.tokens
                record = TrainEvent(
                    step=step,
                    loss=loss_sum / c.grad_accum,
                    lr=float(sched.get_last_lr()[0]),
                    grad_norm=float(grad_norm) if grad_norm is not None else None,
                    tokens=run.tokens,
                    tokens_per_s=rate,
                )
                logger.write(record)
                bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{rate:,.0f}")
            if eval_data is not None and ((c.eval_every and step % c.eval_every == 0) or step == c.steps):
                logger.write(EvalEvent(step, _eval_loss(raw, eval_data, acc.device)))
            if eval_data is not None and ((c.observe_every and step % c.observe_every == 0) or step == c.steps):
                logger.write(_light_observe(raw, eval_data[:1], step))
            if out is not None and ((c.checkpoint_every and step % c.checkpoint_every == 0) or step == stop < c.steps):
                write_checkpoint(run, out / "checkpoints" / f"step-{step}", identity, c)
    acc.wait_for_everyone()
    if out is not None and run.step == c.steps:
        weights = gathered(run)
        if acc.is_main_process:
            save_model(raw, out / "model", tokenizer, weights)
            plot_training(read_log(out / LOG_FILE), out / "training.png")
    # without accelerate's mixed-precision wrapper: what the caller observes, quantizes or evaluates next
    # runs in the model's own dtype, not silently in bf16 autocast. Under FSDP it is each process's shard
    # (a forward pass needs every process); the whole weights are in out/model
    return acc.unwrap_model(model, keep_fp32_wrapper=False)


def _claim(acc: Accelerator, out: Path, c: TrainConfig, model: nn.Module, data: Iterable[Batch]) -> None:
    """Check and claim the run directory ``out`` before anything there changes: checkpointable data where the
    run writes or reads checkpoints, a fresh folder unless resuming; the main process marks it as a run's."""
    if c.checkpoint_every or c.stop_after or c.resume:
        check_checkpointable(acc, data)
    claim_run_dir(out)  # on every process, before anything there changes
    if not c.resume:
        check_fresh(acc, out, c.overwrite, getattr(config_of(model), "_name_or_path", ""))
    if acc.is_main_process:
        claim_run_dir(out, mark=True)
        remove_leftovers(out)


def _optimizer_step(
    run: Run, model: nn.Module, it: Iterator[Batch], c: TrainConfig, out: Path | None, mlm_single: bool
) -> tuple[float, torch.Tensor | None]:
    """One optimizer step of ``c.grad_accum`` micro-batches from ``it``: (the micro-batches' summed loss, the
    clipped gradient norm). A non-finite loss or gradient norm stops the run (:func:`_diverged`)."""
    acc, raw, opt, sched = run.acc, run.model, run.optimizer, run.scheduler
    world, rank = acc.num_processes, acc.process_index
    family = family_of(raw)
    loss_sum, grad_norm = 0.0, None
    for _ in range(c.grad_accum):
        batch = _shard(next(it), rank, world, acc.device)
        with acc.accumulate(model):
            loss = family.masked_lm_loss(raw, batch) if mlm_single else model(**batch).loss
            if not _finite_everywhere(acc, loss):
                _diverged(
                    run, out, f"the loss became non-finite at step {run.step + 1}{_first_nonfinite_block(raw, batch)}"
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
    return loss_sum, grad_norm


def _finite_everywhere(acc: Accelerator, loss: torch.Tensor) -> bool:
    """Whether every process's ``loss`` is finite, so that all stop together (one alone would leave the others
    waiting in the backward pass's collectives)."""
    return bool(torch.isfinite(acc.gather(loss.detach().reshape(1))).all())


def _shard(batch: dict, rank: int, world: int, device) -> dict:
    """This process's rows of a global micro-batch, on its device."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise InputError(f"a global batch of {n} rows does not split over {world} processes")
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


def _light_observe(model: nn.Module, data: list[Batch], step: int) -> ObserveEvent:
    """Per layer: residual max |x|, mean kurtosis, first-token attention, gate mean."""
    report = observe(model, data, progress=False)
    s = report.summary
    return ObserveEvent(
        step=step,
        layers=[LayerPoint(L.max_activation, L.kurtosis, L.sink_mass, L.gate_mean) for L in report.layers],
        max_activation=s.max_activation,
        max_median_ratio=s.max_median_ratio,
        kurtosis=s.kurtosis,
        sink_mass=s.sink_mass,
        gate_mean=s.gate_mean,
    )


def _diverged(run: Run, out: Path | None, what: str) -> NoReturn:
    """Stop: ``what`` happened before this step's update, so the model holds the last completed step's
    weights; write them to ``out/last-good-model`` when all are finite (see :func:`train`)."""
    saved = ""
    weights = gathered(run) if out is not None else None  # every process stops here together
    if out is not None and run.acc.is_main_process:
        if all(bool(torch.isfinite(t).all()) for t in (weights.values() if weights else run.model.parameters())):
            save_model(run.model, out / "last-good-model", weights=weights)
            saved = (
                f"; the last finite weights (after step {run.step}) are in {out}/last-good-model, to "
                f"continue from with --model"
            )
        else:
            saved = f"; the weights were already non-finite, so no last-good-model was written (see {out}/checkpoints)"
    raise TrainingDiverged(f"{what}{saved}. Lower the learning rate or use bf16/fp32")


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
