"""``qg.save`` / ``qg.load``: one pair of verbs for float and quantized models.

A float model is a transformers checkpoint plus quantgate's variant record and gate weights
(:mod:`quantgate.models.io`); a quantized one adds a manifest (:mod:`quantgate.quant.checkpoint`), which
is imported only when a quantized model is saved or loaded. :func:`dedupe` stores tied tensors once,
for every writer of safetensors here (quantized checkpoints, training checkpoints).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from .models import io as model_io
from .models.sources import resolve
from .variants import VariantLike

__all__ = ["save", "load", "dedupe", "QUANTIZED_MANIFEST"]

QUANTIZED_MANIFEST = "quantization.json"  # its presence marks a quantized checkpoint


def save(
    model: nn.Module,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save a float or quantized model (and its tokenizer) to directory ``path``; ``dtype``: the storage dtype
    of a compressed-tensors export's full-precision tensors (:func:`~quantgate.quant.checkpoint.save_quantized`)."""
    if (getattr(model.config, "quantgate", None) or {}).get("quantization"):
        from .quant.checkpoint import save_quantized  # import cycle: quant.checkpoint imports this module

        return save_quantized(model, path, tokenizer, dtype=dtype)
    if dtype is not None:
        raise ValueError("dtype= applies to quantized checkpoints; cast a float model with model.to(dtype) first")
    return model_io.save(model, path, tokenizer)


def load(
    source: str | os.PathLike[str],
    variant: VariantLike = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """Load a float or quantized model (see :func:`quantgate.models.io.load` for the sources)."""
    path = resolve(source)
    if (path / QUANTIZED_MANIFEST).is_file():
        from .quant.checkpoint import load_quantized  # import cycle: quant.checkpoint imports this module

        return load_quantized(path, variant, dtype=dtype, backend=backend)
    return model_io.load(path, variant, dtype=dtype, backend=backend, seed=seed)


def dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop entries that share storage with an earlier one (tied weights); return (tensors, aliases)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[object, str] = {}
    for key, t in state.items():
        ident = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if type(t) is torch.Tensor else id(t)
        if ident in seen:
            aliases[key] = seen[ident]
        else:
            seen[ident], kept[key] = key, t
    return kept, aliases
