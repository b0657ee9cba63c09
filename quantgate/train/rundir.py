"""A run directory, the ``out`` of a training run: what it holds, refusing a folder that is not a training run
of quantgate's (:func:`claim_run_dir`) and another run's files there (:func:`check_fresh`), removing interrupted
writes (:func:`remove_leftovers`), writing a model into it (:func:`save_model`).

Its layout (one writer at a time: the run holds ``.quantgate.lock``, see :mod:`quantgate.runlock`)::

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
                                  every field is checked before a resume uses it
                                  (:class:`~quantgate.train.checkpoint.TrainerRecord`)
    model/                    the final model (``qg.save``), and training.png
    last-good-model/          after a divergence: the last finite weights (see :func:`~quantgate.train.train`)

A folder is written as ``.<name>.tmp`` beside its place, fsynced, and renamed into place once complete,
so an interrupted write never leaves a partial ``step-N`` or ``model``; the next run removes the
leftover with a warning. ``--resume`` continues from the newest complete checkpoint (skipping, with a
warning, folders that are not one) and refuses changed settings (:data:`~quantgate.train.config.FREE_ON_RESUME`),
a changed model config (an activation, a norm's eps: shapes that agree do not make the same model) and optimizer
or schedule state that the config does not make. A run that does not resume refuses a directory holding another
run's files (its model/ and log would describe one run, the checkpoints another) unless ``overwrite`` removes
them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from ..errors import InputError
from ..files import claim_output, publish_folder, temporary_folder
from ..model_files import save
from .checkpoint import can_resume
from .log import LOG_FILE

log = logging.getLogger("quantgate")

RUN_FILES = (LOG_FILE, "model", "last-good-model", "training.png", "tensorboard")  # beside checkpoints/


def claim_run_dir(out: Path, mark: bool = False) -> None:
    """``out`` is a folder a training run may write into (:func:`~quantgate.files.claim_output`): missing or
    empty, or a training run quantgate wrote (whose files :func:`check_fresh` then guards), with no link
    leading out of it; ``mark``: marked as one. Anything else (a study run, a model folder, the user's files) is
    refused, ``overwrite`` or not: overwrite removes an earlier training run's files, nothing else."""
    claim_output(out, "train", "out", mark=mark, by="quantgate train")


def check_fresh(acc: Accelerator, out: Path, overwrite: bool, source: str) -> None:
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
        raise InputError(
            f"{out} holds another training run ({', '.join(found)}): continue it with resume=True (--resume), "
            f"start afresh with overwrite=True (--overwrite, which removes them), or give another out (--out)"
        )
    inside = [
        name
        for name in [*found, "checkpoints"]
        if source and Path(source).resolve().is_relative_to((out / name).resolve())
    ]
    if inside:
        raise InputError(
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


def save_model(
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


def remove_leftovers(out: Path) -> None:
    """Remove the temporary folders of writes that an earlier run did not finish."""
    pattern = temporary_folder(Path("*")).name  # .*.tmp
    for tmp in [*out.glob(pattern), *(out / "checkpoints").glob(pattern)]:
        log.warning("removing %s: an interrupted write of %s", tmp, tmp.name[1:-4])
        shutil.rmtree(tmp)
