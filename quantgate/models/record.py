"""A model's ``quantgate`` record: what quantgate did to it, kept in ``model.config.quantgate`` (a plain dict,
so that config.json carries it) and read and written only through this module.

Fields: the attention ``variant`` and ``family`` (apply_variant), the bundled ``tokenizer`` (build), the
synthetic ``task`` it was trained on (train), the ``quantization`` (quantize: a :class:`QuantizationRecord`), the
``rotation`` (rotate_: a :class:`RotationRecord`) and a pending ``mitigation`` (a :class:`MitigationRecord` of
SmoothQuant, keep=auto and the rotation: moved into the quantization record by quantize), and for a checkpoint
only quantgate loads, the real ``model_type`` and the ``load_with`` note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import InputError
from ..files import json_kind
from ..json_record import JsonRecord, json_field

__all__ = [
    "ModelRecord",
    "QuantizationRecord",
    "CalibrationRecord",
    "MitigationRecord",
    "RotationRecord",
    "SmoothingRecord",
    "record_of",
    "set_record",
    "drop_record",
    "checked_record",
]


@dataclass(frozen=True)
class CalibrationRecord(JsonRecord):
    """The calibration a quantization ran: ``batches`` consumed of the ``requested`` (fewer where the calibration
    set ran out; None in records made before it was kept), their ``tokens`` (all positions of every batch), and the
    data's ``source`` split and ``seq_len`` (tokens per sequence) where the batches say (None otherwise)."""

    batches: int
    requested: int | None = json_field(omit_none=True)
    tokens: int = 0
    source: str | None = None
    seq_len: int | None = None


@dataclass(frozen=True)
class RotationRecord(JsonRecord):
    """A Hadamard rotation (:func:`quantgate.quant.rotate.rotate_`): ``kind`` ("hadamard"), ``online`` (a transform
    at each FFN output projection), the ``seed`` of Q's random signs, ``d_model``, ``d_ff`` (the online transform's
    size; None without it), ``extra_params`` (biases added where a LayerNorm bias folds into a bias-free reader) and
    ``extra_ops_per_token`` (additions and subtractions of the online transforms per token; 0 without them)."""

    kind: str
    online: bool
    seed: int
    d_model: int
    d_ff: int | None
    extra_params: int
    extra_ops_per_token: int


@dataclass(frozen=True)
class SmoothingRecord(JsonRecord):
    """What SmoothQuant did (:func:`quantgate.quant.mitigate.smooth_`): the ``groups`` of Linears smoothed and the
    largest and smallest smoothing factor s (``max_s``, ``min_s``; unitless)."""

    groups: int
    max_s: float
    min_s: float


@dataclass(frozen=True)
class MitigationRecord(JsonRecord):
    """The fixes applied before quantizing (:func:`quantgate.quant.mitigate.mitigate`), each absent where it did
    not run: the ``rotation``, SmoothQuant's ``smooth``, and keep=auto's ``keep`` (the FFNs left in full
    precision, by module name) with ``kept_params`` (the parameters inside them)."""

    rotation: RotationRecord | None = json_field(omit_none=True)
    smooth: SmoothingRecord | None = json_field(omit_none=True)
    keep: list[str] | None = json_field(omit_none=True)
    kept_params: int | None = json_field(omit_none=True)

    @property
    def extra_params(self) -> int:
        """The parameters the fixes cost: those keep=auto leaves in full precision and the rotation's added biases."""
        return (self.kept_params or 0) + (self.rotation.extra_params if self.rotation else 0)

    @property
    def extra_ops_per_token(self) -> int:
        """The operations per token the fixes add: the rotation's online transforms (0 without them)."""
        return self.rotation.extra_ops_per_token if self.rotation else 0


@dataclass(frozen=True)
class QuantizationRecord(JsonRecord):
    """How quantgate quantized a model (:func:`quantgate.quant.quantize` writes it; saved in config.json's
    ``quantgate`` object and the checkpoint's quantization.json): the ``scheme`` (its full text, options included),
    the ``calibration`` that ran (None for a scheme without), the float ``source_model`` (its packaged name or hub
    id, or its folder as an absolute path, where it had one), ``source_sha256`` (its weights' fingerprint as
    quantized) and, for a folder, ``source_files_sha256`` (of its config and weights files, which a reader checks
    before it uses the folder), ``dequantized_from`` (the
    other tool's quantization it was decompressed from) and the ``mitigation`` applied, each absent where none.
    Its ``origin`` (who quantized the model) is quantgate, as :class:`~quantgate.quant.imported.ImportedQuantization`
    names another tool's."""

    origin: ClassVar[str] = "quantgate"
    scheme: str
    calibration: CalibrationRecord | None = None
    source_model: str | None = None
    source_sha256: str | None = None
    source_files_sha256: str | None = json_field(omit_none=True)
    dequantized_from: str | None = json_field(omit_none=True)
    mitigation: MitigationRecord | None = json_field(omit_none=True)

    def with_origin(self) -> dict[str, Any]:
        """The record as JSON after its ``origin`` (as an evaluation keeps it, beside another tool's records)."""
        return {"origin": self.origin, **self.to_json()}


@dataclass(frozen=True)
class ModelRecord(JsonRecord):
    """config.json's ``quantgate`` object, typed (absent fields are None and are not written)."""

    variant: str | None = json_field(omit_none=True)
    family: str | None = json_field(omit_none=True)
    tokenizer: str | None = json_field(omit_none=True)
    task: str | None = json_field(omit_none=True)
    quantization: QuantizationRecord | None = json_field(omit_none=True)
    rotation: RotationRecord | None = json_field(omit_none=True)
    mitigation: MitigationRecord | None = json_field(omit_none=True)
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


_TYPES = {f.name: str if f.type == "str | None" else dict for f in dataclasses.fields(ModelRecord)}


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
    try:
        return ModelRecord.from_json(meta)
    except (InputError, TypeError) as e:  # a field inside one of its objects unknown, or missing
        raise InputError(f"{file}: field 'quantgate' is not the record qg.save writes ({e}); {fix}") from None
