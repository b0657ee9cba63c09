"""``qg.save`` / ``qg.load``: one pair of verbs for float and quantized models.

A float model is a transformers checkpoint plus quantgate's variant record and gate weights
(:mod:`quantgate.models.io`); a quantized one adds a manifest (:mod:`quantgate.quant.manifest`), which
holds the formats other tools read and write.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from transformers import PreTrainedTokenizerBase

from .errors import InputError
from .files import mark_output, refuse_same, staged_dir, write_failure
from .models import io as model_io
from .models.presets import PRESETS
from .models.record import record_of
from .models.sources import PACKAGED, resolve
from .quant.manifest import MANIFEST, load_quantized, save_quantized
from .variants import VariantLike

__all__ = ["save", "load", "load_or_build"]

# the files a checkpoint folder consists of (float or quantized, any layout): a save replaces them all
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    MANIFEST,
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.jinja",
)


def save(
    model: nn.Module,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    dtype: torch.dtype | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Save a float or quantized model (and its tokenizer) to directory ``path``; ``dtype``: the storage dtype
    of a compressed-tensors export's full-precision tensors (:func:`~quantgate.quant.manifest.save_quantized`);
    ``weights``: a float model's weights gathered whole, where the model holds only its shard (FSDP).

    The checkpoint is written beside ``path`` and then moved in, replacing every checkpoint file there
    (:data:`CHECKPOINT_FILES`; other files stay), so a float model saved where a quantized one was leaves
    no manifest or quantized weights behind. A save that fails (a full disk) leaves ``path`` as it was and
    says so in one line. A quantized model is not saved over the float checkpoint it was quantized from.
    The folder is marked as a model quantgate saved (:data:`~quantgate.files.MARKER`), which the commands'
    output rule reads (:func:`~quantgate.files.claim_output`: ``quantgate quantize --out`` replaces it only
    with ``--overwrite``); this function itself checks no ownership, as before."""
    quantization = record_of(model).quantization
    if dtype is not None and not quantization:
        raise InputError("dtype= applies to quantized checkpoints; cast a float model with model.to(dtype) first")
    if weights is not None and quantization:
        raise InputError("weights= applies to float models; a quantized model is saved from its own tensors")
    source = quantization.source_model if quantization else None
    if source and Path(str(source)).is_dir():
        refuse_same(path, source, "the float checkpoint this model was quantized from")
    try:
        with staged_dir(path, CHECKPOINT_FILES) as staged:
            mark_output(staged, "model", by="qg.save")
            if quantization:
                save_quantized(model, staged, tokenizer, dtype=dtype)
            else:
                model_io.save(model, staged, tokenizer, weights=weights)
    except (OSError, SafetensorError) as e:  # a full or read-only disk
        raise InputError(f"cannot save the model to {path}: {write_failure(e)}; {path} is left as it was") from None
    return Path(path)


def load(
    source: str | os.PathLike[str],
    variant: VariantLike = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    seed: int = 0,
    placement: model_io.Placement | None = None,
) -> nn.Module:
    """Load a float or quantized model (see :func:`quantgate.models.io.load` for the sources); ``placement``
    shards a float one over devices, CPU and disk as it loads (:class:`~quantgate.models.io.Placement`)."""
    path = resolve(source)
    if (path / MANIFEST).is_file():
        if placement is not None:
            raise InputError(
                f"{path} is a quantized checkpoint, which loads whole: load it without --device-map, or load its "
                f"float source with --device-map and quantize that"
            )
        return load_quantized(path, variant, dtype=dtype, backend=backend)
    return model_io.load(path, variant, dtype=dtype, backend=backend, seed=seed, placement=placement)


def load_or_build(
    source: str,
    variant: VariantLike = None,
    *,
    dtype: torch.dtype | None = None,
    placement: model_io.Placement | None = None,
) -> nn.Module:
    """What quantgate's commands read a model from: a packaged checkpoint or directory loads (:func:`load`), another
    preset name builds a fresh model (seed 0), which cannot be placed (``placement``)."""
    if source in PRESETS and source not in PACKAGED and not Path(source).exists():
        if placement is not None:
            raise InputError(f"{source} is a preset, built whole: save it (quantgate train or qg.save) to place it")
        return model_io.build(source, variant, dtype=dtype)
    return load(source, variant, dtype=dtype, placement=placement)
