"""Quantized checkpoints: the weights in a format other tools read where one holds the model, plus a manifest.

A quantized directory holds config.json (with the variant and the quantization record), the weights and
``quantization.json`` (a :class:`~quantgate.quant.formats.Manifest`): scheme and options, calibration data and
size, the source model and the sha256 of its weights, the format and sha256 of the weights file, the backend's and
the format's saved state, library versions. The format is the backend's choice
(:func:`~quantgate.quant.export.export_format`), and its entry writes the weights and, for a format other tools
read (``model.safetensors``, which transformers, lm-eval and vLLM load as they load any such checkpoint), the
``quantization_config`` in config.json; quantgate's own layout (``quantized.safetensors``, torchao tensor
subclasses flattened with torchao's helpers) has none, and config.json's model type becomes ``quantgate`` so that
other tools refuse it. Tensors that share storage, like tied embeddings, are stored once. Loading checks the
manifest (its fields, their agreement with config.json and the weights file's sha256), rebuilds the model from
config.json, lays out the scheme's structure without calibrating (the handler's ``restore``, given the manifest),
has the format read the stored tensors back and loads them: outputs are identical to the saved model's.

``qg.save`` / ``qg.load`` (:mod:`quantgate.model_files`) send quantized models here.
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

from ..errors import InputError, MissingFile
from ..files import file_sha256
from ..json_record import RecordError
from ..models import io as model_io
from ..models.families import config_of, family_of
from ..models.record import ModelRecord, drop_record, record_of, set_record
from ..models.sources import tokenizer as get_tokenizer
from ..models.swap import apply_variant, variant_of
from ..provenance import versions
from ..variants import AttentionVariant, VariantLike
from .export import compute_dtype, export_format, format_of, formats
from .formats import OWN_WEIGHTS, Format, Manifest
from .imported import SIDECAR, sidecar_json
from .schemes import Handler, get_scheme, handler_for
from .simulate import check_ranges

__all__ = ["save_quantized", "load_quantized", "content_sha256", "MANIFEST", "WEIGHTS", "ECOSYSTEM_WEIGHTS"]

MANIFEST = SIDECAR  # quantgate's manifest: its presence marks a quantized checkpoint
WEIGHTS = OWN_WEIGHTS  # quantgate's own layout
ECOSYSTEM_WEIGHTS = "model.safetensors"  # the layout of the formats other tools read, as transformers names it
_PACKAGES = ("torch", "transformers", "torchao", "bitsandbytes", "safetensors", "quantgate")
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
    format :func:`~quantgate.quant.export.export_format` picks. ``dtype`` (formats that take it only, e.g.
    ``torch.bfloat16``): store the tensors left in full precision (embeddings,
    norms, the LM head, biases) in that dtype, as llm-compressor's exports are; the scales stay float32 and
    quantgate, like transformers, loads them back into a float32 model, so the reloaded model is the stored one."""
    config = config_of(model)
    quant = record_of(config).quantization
    assert quant is not None, "qg.save sends only quantized models here"
    scheme = get_scheme(quant.scheme)
    check_ranges(model)
    name, why = export_format(model, scheme)
    fmt = format_of(scheme, name)
    if dtype is not None and not fmt.takes_dtype:
        takers = " or ".join(f.name for f in formats().values() if f.takes_dtype)
        raise InputError(
            f"dtype= stores a {takers} export's full-precision tensors in another dtype; {scheme} is "
            f"saved in the {fmt.name} format ({why or 'its own tensors'}): save it without dtype="
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    written = fmt.write(model, scheme, dtype)
    weights = _write_weights(path, fmt, written.tensors)
    aliases = weights[1]
    config.save_pretrained(path)
    if written.quantization_config is not None:  # with the dtype the model computes in, whatever the storage dtype
        fields = {"quantization_config": written.quantization_config, "dtype": compute_dtype(model, scheme)}
        _add_to_config(path, fields)
    else:
        model_io.mark_quantgate_only(path, f"it is quantized with {quant.scheme} and {why}")
    handler = handler_for(scheme)
    manifest = Manifest.of(
        quant,
        variant=str(variant_of(model)),
        family=family_of(model).name,
        format=fmt.name,
        aliases=aliases,
        state=handler.state.of(model) if handler.state is not None else None,
        format_state=written.state,
        weights_file=fmt.weights_file,
        stored_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        weights_sha256=file_sha256(weights[0]),
        versions={**versions(_PACKAGES), "python": platform.python_version()},
        content_sha256="",
    )
    content = content_sha256(json.loads(json.dumps(manifest.to_json())), path)  # as it is read back
    (path / MANIFEST).write_text(json.dumps(manifest.with_content_sha256(content).to_json(), indent=1))
    if tokenizer is None:
        try:
            tokenizer = get_tokenizer(model)
        except (InputError, MissingFile, ModuleNotFoundError):  # none known, or a library to install
            tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _write_weights(path: Path, fmt: Format, state: Mapping[str, torch.Tensor]) -> tuple[Path, dict[str, str]]:
    """Write ``state`` to ``fmt``'s weights file in ``path``, tied tensors once, removing another format's file
    left there; returns (the file, the aliases of the tensors stored once)."""
    tensors, aliases = dedupe(state)
    metadata_ = {}
    if any(type(t) is not torch.Tensor for t in tensors.values()):
        from torchao.prototype.safetensors.safetensors_support import (  # torchao prototype: imported at first use
            flatten_tensor_state_dict,
        )

        tensors, metadata_ = flatten_tensor_state_dict(tensors)
    weights = path / fmt.weights_file
    others = {path / f.weights_file for f in formats().values()} | {path / model_io.GATED_WEIGHTS}
    for stale in others - {weights}:  # a save over another format's
        stale.unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt", **metadata_})
    return weights, aliases


def _add_to_config(path: Path, fields: dict[str, Any]) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}, indent=2, sort_keys=True) + "\n")


def load_quantized(
    path: Path, variant: VariantLike = None, *, dtype: torch.dtype | None = None, backend: str = "auto"
) -> nn.Module:
    """Load the quantized checkpoint in directory ``path`` (``qg.load`` sends it here)."""
    config = model_io.read_config(path)
    manifest, fmt, data = _read_manifest(path, config)
    if variant is not None and str(variant) != manifest.variant:
        raise InputError(f"{path} is a quantized {manifest.variant} model; it cannot be loaded as {variant}")
    weights = path / manifest.weights_file
    state = _read(weights)
    if file_sha256(weights) != manifest.weights_sha256:
        raise InputError(
            f"{weights} does not match the sha256 recorded in {path / MANIFEST} (field "
            f"'weights_sha256'): the weights file was changed or the manifest belongs to another "
            f"save; {_RESAVE}"
        )
    missing = {alias: original for alias, original in manifest.aliases.items() if original not in state}
    if missing:
        alias, original = next(iter(missing.items()))
        raise InputError(
            f"{path / MANIFEST}: field 'aliases' maps {alias} to tensor {original}, which {weights} does not hold; "
            f"{_RESAVE}"
        )
    if content_sha256(data, path) != manifest.content_sha256:  # over the JSON as written, whatever its layout
        raise InputError(
            f"{path / MANIFEST} or {path / 'config.json'} was edited after saving: they no longer match the sha256 "
            f"of their content recorded in field 'content_sha256' (the scheme, quantizer state and config decide "
            f"the loaded model's numbers, so it would not be the saved model); {_RESAVE}"
        )
    model, handler, record = _restored(config, manifest, backend)
    for alias, original in manifest.aliases.items():
        state[alias] = state[original]
    if fmt.read is not None:
        state = fmt.read(model, get_scheme(manifest.scheme), state, manifest.format_state)
    try:
        model.load_state_dict(state, strict=True, assign=handler.assign)
    except RuntimeError as e:
        raise InputError(f"{weights} does not match its config and manifest: {e}") from None
    set_record(model, record)
    model.eval()
    return model.to(dtype) if dtype is not None else model


def _restored(config: PreTrainedConfig, manifest: Manifest, backend: str) -> tuple[nn.Module, Handler, ModelRecord]:
    """The model config.json describes, its variant applied and its scheme's structure laid out by the handler's
    ``restore``, without its saved tensors nor its quantgate record; the handler, and the record."""
    config = copy.deepcopy(config)
    record = drop_record(config)
    config.__dict__.pop("quantization_config", None)  # quantgate lays the structure out itself
    family = family_of(config)
    scheme = get_scheme(manifest.scheme)
    with torch.random.fork_rng(devices=[]):
        model: nn.Module = family.model_class(config)(config)
    apply_variant(model, manifest.variant, backend=backend, announce=False)  # its values are in the state
    handler = handler_for(scheme)
    handler.restore(model, scheme, manifest)
    return model, handler, record


def _read_manifest(path: Path, config: PreTrainedConfig) -> tuple[Manifest, Format, dict[str, Any]]:
    """The manifest of ``path``, the format of its weights and the JSON it was read from, checked: its fields and
    their types, a valid scheme and variant, a format of the scheme's backend, the same scheme, variant and family
    as config.json's quantgate record."""
    file = path / MANIFEST
    data = sidecar_json(path, fix=_RESAVE)
    if data is None:
        raise InputError(f"{file} is missing; {_RESAVE}")
    for field in Manifest.required():
        if field not in data:
            raise InputError(f"{file}: field {field!r} is missing; {_RESAVE}")
    for field, parse in (("scheme", get_scheme), ("variant", AttentionVariant.parse)):
        if not isinstance(data[field], str):
            raise InputError(f"{file}: field {field!r} is {data[field]!r}, not a string; {_RESAVE}")
        try:
            parse(data[field])
        except InputError as e:
            raise InputError(f"{file}: field {field!r} is not a valid {field}: {e}; {_RESAVE}") from None
    scheme = get_scheme(data["scheme"])
    handler = handler_for(scheme)
    try:
        fmt = format_of(scheme, data.get("format", Manifest.format))
    except InputError as e:
        raise InputError(f"{file}: field 'format': {e}; {_RESAVE}") from None
    try:
        manifest = Manifest.read(data, handler.state, fmt.state)
    except RecordError as e:
        raise InputError(f"{file}: field {e.at!r} {e.problem}; {_RESAVE}") from None
    except InputError as e:
        raise InputError(f"{file}: {e}; {_RESAVE}") from None
    if manifest.weights_file != fmt.weights_file:
        raise InputError(f"{file}: field 'weights_file' must be {fmt.weights_file} ({fmt.name} format); {_RESAVE}")
    _check_against_config(file, manifest, config)
    return manifest, fmt, data


def _check_against_config(file: Path, manifest: Manifest, config: PreTrainedConfig) -> None:
    """Refuse a manifest whose scheme, variant or family is not config.json's."""
    record = record_of(config)
    recorded = {
        "scheme": (manifest.scheme, record.quantization.scheme if record.quantization else None),
        "variant": (manifest.variant, record.variant),
        "family": (manifest.family, family_of(config).name),
    }
    for field, (value, in_config) in recorded.items():
        if value != in_config:
            raise InputError(
                f"{file}: field {field!r} ({value!r}) disagrees with {file.parent / 'config.json'} "
                f"({in_config!r}): one of them was edited or comes from another save; {_RESAVE}"
            )


def content_sha256(manifest: Mapping[str, Any], path: Path) -> str:
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
