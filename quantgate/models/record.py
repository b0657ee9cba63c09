"""A model's ``quantgate`` record: what quantgate did to it, kept in ``model.config.quantgate`` (a plain dict,
so that config.json carries it) and read and written only through this module.

Fields: the attention ``variant`` and ``family`` (apply_variant), the bundled ``tokenizer`` (build), the
synthetic ``task`` it was trained on (train), the ``quantization`` (quantize), the ``rotation`` (rotate_)
and a pending ``mitigation`` (SmoothQuant, keep=auto: moved into the quantization record by quantize), and
for a checkpoint only quantgate loads, the real ``model_type`` and the ``load_with`` note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..files import json_kind
from ..json_record import JsonRecord, json_field

__all__ = ["ModelRecord", "record_of", "set_record", "drop_record", "checked_record"]


@dataclass(frozen=True)
class ModelRecord(JsonRecord):
    """config.json's ``quantgate`` object, typed (absent fields are None and are not written)."""

    variant: str | None = json_field(omit_none=True)
    family: str | None = json_field(omit_none=True)
    tokenizer: str | None = json_field(omit_none=True)
    task: str | None = json_field(omit_none=True)
    quantization: dict[str, Any] | None = json_field(omit_none=True)
    rotation: dict[str, Any] | None = json_field(omit_none=True)
    mitigation: dict[str, Any] | None = json_field(omit_none=True)
    model_type: str | None = json_field(omit_none=True)
    load_with: str | None = json_field(omit_none=True)


def _config(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def record_of(model_or_config: Any) -> ModelRecord:
    """The record of a model or its config (an empty one where quantgate has not touched it)."""
    return ModelRecord.from_json(getattr(_config(model_or_config), "quantgate", None) or {})


def set_record(model_or_config: Any, record: ModelRecord | None = None, **changes: Any) -> ModelRecord:
    """Change fields of the record (None removes one), or of ``record`` put in its place; returns the new one."""
    record = dataclasses.replace(record if record is not None else record_of(model_or_config), **changes)
    _config(model_or_config).quantgate = record.to_json()
    return record


def drop_record(config: Any) -> ModelRecord:
    """Take the record off ``config`` (a plain transformers config, for a model quantgate rebuilds)."""
    record = record_of(config)
    config.__dict__.pop("quantgate", None)
    return record


_TYPES = {f.name: dict if f.type.startswith("dict") else str for f in dataclasses.fields(ModelRecord)}


def checked_record(data: Mapping[str, Any], file: Path, fix: str) -> ModelRecord:
    """The record in config.json contents ``data`` read from ``file``, checked: an object of known fields
    with their types; a one-line ValueError naming the field and ``fix``."""
    meta = data.get("quantgate")
    if meta is None:
        return ModelRecord()
    if not isinstance(meta, dict):
        raise InputError(
            f"{file}: field 'quantgate' must be an object (the record qg.save writes), got a JSON "
            f"{json_kind(meta)}; {fix}, or delete the field"
        )
    for key, value in meta.items():
        want = _TYPES.get(key)
        if want is None:
            raise InputError(f"{file}: field 'quantgate.{key}' is not one quantgate writes; {fix}")
        if not isinstance(value, want):
            raise InputError(
                f"{file}: field 'quantgate.{key}' must be {'a string' if want is str else 'an object'}, got a "
                f"JSON {json_kind(value)}; {fix}"
            )
    return ModelRecord.from_json(meta)
