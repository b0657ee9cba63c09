"""Quantized checkpoints: safetensors of the quantized state dict plus a manifest.

A quantized directory holds config.json (with the variant and the quantization record),
``quantized.safetensors`` (torchao tensor subclasses flattened with torchao's helpers; tensors that
share storage, like tied embeddings, stored once) and ``quantization.json``: scheme and options,
calibration data and size, the source model and the sha256 of its weights, the sha256 of
``quantized.safetensors``, library versions. Loading checks the manifest (its fields, their agreement
with config.json and the weights file's sha256), rebuilds the model from config.json, lays out the
scheme's structure without calibrating, and loads the state: outputs are identical to the saved model's.

``qg.save`` / ``qg.load`` (:mod:`quantgate.checkpoint`) send quantized models here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import PreTrainedConfig, PreTrainedTokenizerBase

from ..checkpoint import QUANTIZED_MANIFEST, dedupe
from ..models import io as model_io
from ..models.families import config_of, family_of
from ..models.sources import tokenizer as get_tokenizer
from ..models.swap import apply_variant, variant_of
from ..provenance import versions
from ..variants import AttentionVariant, VariantLike
from .backends import torchao_input_ndims
from .schemes import get_scheme, handler_for
from .simulate import check_ranges

__all__ = ["save_quantized", "load_quantized", "MANIFEST", "WEIGHTS"]

MANIFEST = QUANTIZED_MANIFEST
WEIGHTS = "quantized.safetensors"
_PACKAGES = ("torch", "transformers", "torchao", "bitsandbytes", "safetensors", "quantgate")
_FIELDS = {"scheme": str, "variant": str, "family": str, "aliases": dict, "input_ndims": dict, "weights_sha256": str}
_RESAVE = "save the quantized model again (qg.save, or quantgate quantize)"


def save_quantized(model: nn.Module, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """Save a quantized model (and its tokenizer) to directory ``path`` (``qg.save`` sends it here)."""
    config = config_of(model)
    quant = config.quantgate["quantization"]
    check_ranges(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, aliases = dedupe(model.state_dict())
    metadata_ = {}
    if any(type(t) is not torch.Tensor for t in tensors.values()):
        from torchao.prototype.safetensors.safetensors_support import (  # torchao prototype: imported at first use
            flatten_tensor_state_dict,
        )

        tensors, metadata_ = flatten_tensor_state_dict(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS), metadata=metadata_ or None)
    config.save_pretrained(path)
    manifest = {
        **quant,
        "variant": str(variant_of(model)),
        "family": family_of(model).name,
        "aliases": aliases,
        "input_ndims": torchao_input_ndims(model),
        "weights_sha256": _sha256(path / WEIGHTS),
        "versions": {**versions(_PACKAGES), "python": platform.python_version()},
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if tokenizer is None:
        try:
            tokenizer = get_tokenizer(model)
        except (ValueError, FileNotFoundError, ModuleNotFoundError):
            tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_quantized(
    path: Path, variant: VariantLike = None, *, dtype: torch.dtype | None = None, backend: str = "auto"
) -> nn.Module:
    """Load the quantized checkpoint in directory ``path`` (``qg.load`` sends it here)."""
    config = model_io.read_config(path)
    manifest = _read_manifest(path, config)
    if variant is not None and str(variant) != manifest["variant"]:
        raise ValueError(f"{path} is a quantized {manifest['variant']} model; it cannot be loaded as {variant}")
    state = _read(path / WEIGHTS)
    if _sha256(path / WEIGHTS) != manifest["weights_sha256"]:
        raise ValueError(
            f"{path / WEIGHTS} does not match the sha256 recorded in {path / MANIFEST} (field "
            f"'weights_sha256'): the weights file was changed or the manifest belongs to another "
            f"save; {_RESAVE}"
        )
    meta = config.quantgate
    config = copy.deepcopy(config)
    config.__dict__.pop("quantgate")
    family = family_of(config)
    scheme = get_scheme(manifest["scheme"])
    with torch.random.fork_rng(devices=[]):
        model: nn.Module = family.model_class(config)(config)
    apply_variant(model, manifest["variant"], backend=backend)
    handler = handler_for(scheme)
    handler.restore(model, scheme, manifest)
    for alias, original in manifest["aliases"].items():
        state[alias] = state[original]
    try:
        model.load_state_dict(state, strict=True, assign=handler.assign)
    except RuntimeError as e:
        raise ValueError(f"{path / WEIGHTS} does not match its config and manifest: {e}") from None
    config_of(model).quantgate = {**meta}
    model.eval()
    return model.to(dtype) if dtype is not None else model


def _read_manifest(path: Path, config: PreTrainedConfig) -> dict[str, Any]:
    """The manifest of ``path``, checked: its fields and their types, a valid scheme and variant, and the
    same scheme, variant and family as config.json's quantgate record."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); {_RESAVE}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(manifest).__name__}; {_RESAVE}")
    for field, typ in _FIELDS.items():
        if field not in manifest:
            raise ValueError(f"{file}: field {field!r} is missing; {_RESAVE}")
        if not isinstance(manifest[field], typ):
            raise ValueError(
                f"{file}: field {field!r} must be {'a string' if typ is str else 'an object'}, got "
                f"{type(manifest[field]).__name__}; {_RESAVE}"
            )
    for field, parse in (("scheme", get_scheme), ("variant", AttentionVariant.parse)):
        try:
            parse(manifest[field])
        except ValueError as e:
            raise ValueError(f"{file}: field {field!r} is not a valid {field}: {e}; {_RESAVE}") from None
    meta = getattr(config, "quantgate", None) or {}
    recorded = {
        "scheme": (meta.get("quantization") or {}).get("scheme"),
        "variant": meta.get("variant"),
        "family": family_of(config).name,
    }
    for field, value in recorded.items():
        if manifest[field] != value:
            raise ValueError(
                f"{file}: field {field!r} ({manifest[field]!r}) disagrees with {path / 'config.json'} "
                f"({value!r}): one of them was edited or comes from another save; {_RESAVE}"
            )
    return manifest


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _read(file: Path) -> dict[str, torch.Tensor]:
    tensors, meta = model_io.read_safetensors_with_metadata(
        file, incomplete="the quantized checkpoint is incomplete; save it again", fix="save the model again"
    )
    if any(k != "format" for k in meta):
        from torchao.prototype.safetensors.safetensors_support import (  # torchao prototype: imported at first use
            unflatten_tensor_state_dict,
        )

        tensors, leftover = unflatten_tensor_state_dict(tensors, meta)
        tensors.update(leftover)
    return tensors
