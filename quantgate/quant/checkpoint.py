"""Quantized checkpoints: the weights in a format other tools read where one holds the model, plus a manifest.

A quantized directory holds config.json (with the variant and the quantization record), the weights and
``quantization.json``: scheme and options, calibration data and size, the source model and the sha256 of
its weights, the format and sha256 of the weights file, library versions. The weights file and the
``quantization_config`` in config.json follow :func:`~quantgate.quant.export.export_format`:
``model.safetensors`` in compressed-tensors', transformers' torchao or bitsandbytes layout, which
transformers, lm-eval and vLLM load as they load any such checkpoint; or ``quantized.safetensors``
in quantgate's own layout (torchao tensor subclasses flattened with torchao's helpers), with config.json's
model type ``quantgate`` so that other tools refuse it. Tensors that share storage, like tied
embeddings, are stored once. Loading checks the manifest (its fields, their agreement with config.json
and the weights file's sha256), rebuilds the model from config.json, lays out the scheme's structure
without calibrating, and loads the state: outputs are identical to the saved model's.

``qg.save`` / ``qg.load`` (:mod:`quantgate.checkpoint`) send quantized models here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import PreTrainedConfig, PreTrainedTokenizerBase

from ..errors import InputError
from ..files import file_sha256
from ..models import io as model_io
from ..models.families import config_of, family_of
from ..models.record import drop_record, record_of, set_record
from ..models.sources import tokenizer as get_tokenizer
from ..models.swap import apply_variant, variant_of
from ..provenance import versions
from ..variants import AttentionVariant, VariantLike
from .backends import torchao_input_ndims
from .export import (
    FORMATS,
    compressed_tensors_state,
    compute_dtype,
    export_format,
    from_compressed_tensors,
    hf_quantization_config,
)
from .imported import SIDECAR
from .schemes import get_scheme, handler_for
from .simulate import check_ranges

__all__ = ["save_quantized", "load_quantized", "MANIFEST", "WEIGHTS", "ECOSYSTEM_WEIGHTS"]

MANIFEST = SIDECAR  # quantgate's manifest: its presence marks a quantized checkpoint
WEIGHTS = "quantized.safetensors"  # quantgate's own layout
ECOSYSTEM_WEIGHTS = (
    "model.safetensors"  # compressed-tensors', torchao's or bitsandbytes' layout, as transformers names it
)
_PACKAGES = ("torch", "transformers", "torchao", "bitsandbytes", "safetensors", "quantgate")
_FIELDS = {
    "scheme": str,
    "variant": str,
    "family": str,
    "aliases": dict,
    "input_ndims": dict,
    "weights_sha256": str,
    "content_sha256": str,
}
_UNHASHED = ("versions", "content_sha256")  # the libraries that saved it (provenance), and the hash itself
_RESAVE = "save the quantized model again (qg.save, or quantgate quantize)"


def save_quantized(
    model: nn.Module,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save a quantized model (and its tokenizer) to directory ``path`` (``qg.save`` sends it here), in the
    format :func:`~quantgate.quant.export.export_format` picks. ``dtype`` (compressed-tensors exports only,
    e.g. ``torch.bfloat16``): store the tensors left in full precision (embeddings, norms, the LM head,
    biases) in that dtype, as llm-compressor's exports are; the scales stay float32 and quantgate, like
    transformers, loads them back into a float32 model, so the reloaded model is the stored one."""
    config = config_of(model)
    quant = record_of(config).quantization
    assert quant is not None, "qg.save sends only quantized models here"
    scheme = get_scheme(quant.scheme)
    check_ranges(model)
    fmt, why = export_format(model, scheme)
    if dtype is not None and fmt != "compressed-tensors":
        raise InputError(
            f"dtype= stores a compressed-tensors export's full-precision tensors in another dtype; {scheme} is "
            f"saved in the {fmt} format ({why or 'its own tensors'}): save it without dtype="
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranges: dict[str, list[float]] = {}
    quantization_config: dict[str, Any] | None
    if fmt == "compressed-tensors":
        state, quantization_config, ranges = compressed_tensors_state(model, scheme, dtype)
    else:
        state = model.state_dict()
        quantization_config = hf_quantization_config(model, scheme) if fmt != "quantgate" else None
    tensors, aliases = dedupe(state)
    metadata_ = {}
    if any(type(t) is not torch.Tensor for t in tensors.values()):
        from torchao.prototype.safetensors.safetensors_support import (  # torchao prototype: imported at first use
            flatten_tensor_state_dict,
        )

        tensors, metadata_ = flatten_tensor_state_dict(tensors)
    weights = path / (WEIGHTS if fmt == "quantgate" else ECOSYSTEM_WEIGHTS)
    others = {path / WEIGHTS, path / ECOSYSTEM_WEIGHTS, path / model_io.GATED_WEIGHTS} - {weights}
    for stale in others:  # a save over another format's
        stale.unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt", **metadata_})
    config.save_pretrained(path)
    if quantization_config is not None:  # with the dtype the model computes in, whatever the storage dtype
        _add_to_config(path, {"quantization_config": quantization_config, "dtype": compute_dtype(model, scheme)})
    else:
        model_io.mark_quantgate_only(path, f"it is quantized with {quant.scheme} and {why}")
    manifest = {
        **quant.to_json(),
        "variant": str(variant_of(model)),
        "family": family_of(model).name,
        "format": fmt,
        "aliases": aliases,
        "input_ndims": torchao_input_ndims(model),
        **({"act_ranges": ranges} if ranges else {}),
        "weights_file": weights.name,
        **({"stored_dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {}),
        "weights_sha256": file_sha256(weights),
        "versions": {**versions(_PACKAGES), "python": platform.python_version()},
    }
    manifest["content_sha256"] = _content_sha256(json.loads(json.dumps(manifest)), path)  # as it is read back
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if tokenizer is None:
        try:
            tokenizer = get_tokenizer(model)
        except (ValueError, FileNotFoundError, ModuleNotFoundError):
            tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _add_to_config(path: Path, fields: dict[str, Any]) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}, indent=2, sort_keys=True) + "\n")


def load_quantized(
    path: Path, variant: VariantLike = None, *, dtype: torch.dtype | None = None, backend: str = "auto"
) -> nn.Module:
    """Load the quantized checkpoint in directory ``path`` (``qg.load`` sends it here)."""
    config = model_io.read_config(path)
    manifest = _read_manifest(path, config)
    if variant is not None and str(variant) != manifest["variant"]:
        raise InputError(f"{path} is a quantized {manifest['variant']} model; it cannot be loaded as {variant}")
    weights = path / manifest.get("weights_file", WEIGHTS)
    state = _read(weights)
    if file_sha256(weights) != manifest["weights_sha256"]:
        raise InputError(
            f"{weights} does not match the sha256 recorded in {path / MANIFEST} (field "
            f"'weights_sha256'): the weights file was changed or the manifest belongs to another "
            f"save; {_RESAVE}"
        )
    missing = {alias: original for alias, original in manifest["aliases"].items() if original not in state}
    if missing:
        alias, original = next(iter(missing.items()))
        raise InputError(
            f"{path / MANIFEST}: field 'aliases' maps {alias} to tensor {original}, which {weights} does not hold; "
            f"{_RESAVE}"
        )
    if _content_sha256(manifest, path) != manifest["content_sha256"]:
        raise InputError(
            f"{path / MANIFEST} or {path / 'config.json'} was edited after saving: they no longer match the sha256 "
            f"of their content recorded in field 'content_sha256' (the scheme, quantizer state and config decide "
            f"the loaded model's numbers, so it would not be the saved model); {_RESAVE}"
        )
    config = copy.deepcopy(config)
    record = drop_record(config)
    config.__dict__.pop("quantization_config", None)  # quantgate lays the structure out itself
    family = family_of(config)
    scheme = get_scheme(manifest["scheme"])
    with torch.random.fork_rng(devices=[]):
        model: nn.Module = family.model_class(config)(config)
    apply_variant(model, manifest["variant"], backend=backend, announce=False)  # its values are in the state
    handler = handler_for(scheme)
    handler.restore(model, scheme, manifest)
    for alias, original in manifest["aliases"].items():
        state[alias] = state[original]
    if manifest.get("format") == "compressed-tensors":
        state = from_compressed_tensors(model, state, manifest)
    try:
        model.load_state_dict(state, strict=True, assign=handler.assign)
    except RuntimeError as e:
        raise InputError(f"{weights} does not match its config and manifest: {e}") from None
    set_record(model, record)
    model.eval()
    return model.to(dtype) if dtype is not None else model


def _read_manifest(path: Path, config: PreTrainedConfig) -> dict[str, Any]:
    """The manifest of ``path``, checked: its fields and their types, a valid scheme and variant, and the
    same scheme, variant and family as config.json's quantgate record."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise InputError(f"{file} is not valid JSON ({e}); {_RESAVE}") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{file} must hold a JSON object, got {type(manifest).__name__}; {_RESAVE}")
    for field, typ in _FIELDS.items():
        if field not in manifest:
            raise InputError(f"{file}: field {field!r} is missing; {_RESAVE}")
        if not isinstance(manifest[field], typ):
            raise InputError(
                f"{file}: field {field!r} must be {'a string' if typ is str else 'an object'}, got "
                f"{type(manifest[field]).__name__}; {_RESAVE}"
            )
    for field, parse in (("scheme", get_scheme), ("variant", AttentionVariant.parse)):
        try:
            parse(manifest[field])
        except ValueError as e:
            raise InputError(f"{file}: field {field!r} is not a valid {field}: {e}; {_RESAVE}") from None
    if manifest.get("weights_file", WEIGHTS) not in (WEIGHTS, ECOSYSTEM_WEIGHTS):
        raise InputError(f"{file}: field 'weights_file' must be {WEIGHTS} or {ECOSYSTEM_WEIGHTS}; {_RESAVE}")
    if manifest.get("format", "quantgate") not in FORMATS:
        raise InputError(f"{file}: field 'format' must be one of {', '.join(FORMATS)}; {_RESAVE}")
    record = record_of(config)
    recorded = {
        "scheme": record.quantization.scheme if record.quantization else None,
        "variant": record.variant,
        "family": family_of(config).name,
    }
    for field, value in recorded.items():
        if manifest[field] != value:
            raise InputError(
                f"{file}: field {field!r} ({manifest[field]!r}) disagrees with {path / 'config.json'} "
                f"({value!r}): one of them was edited or comes from another save; {_RESAVE}"
            )
    return manifest


def _content_sha256(manifest: dict[str, Any], path: Path) -> str:
    """sha256 over what decides a loaded model's numbers beside its weights: the manifest (scheme, variant,
    family, quantizer state such as activation ranges and input ranks, the weights file's sha256; the library
    versions aside) and the config.json of ``path``."""
    fields = {k: v for k, v in manifest.items() if k not in _UNHASHED}
    config = json.loads((path / "config.json").read_text())
    return hashlib.sha256(json.dumps([fields, config], sort_keys=True).encode()).hexdigest()


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
