"""What a quantized checkpoint holds, as records: the manifest (quantization.json), a backend's saved state and the
formats its weights are written in.

A backend (a :class:`~quantgate.quant.schemes.Handler`) names the formats it writes (:class:`Format`: a name, a
``write`` and a ``read``, the weights file's name, the record of the format's own state) and, where restoring it
needs more than its scheme and the weights, its saved state as a :class:`BackendState` record. quantgate's own
format, :data:`QUANTGATE`, holds any model: every backend may name it. ``qg.save`` writes the manifest as a
:class:`Manifest` record and ``qg.load`` reads it back into one, the backend's and the format's state typed, and
hands it to the handler's ``restore`` (:mod:`quantgate.quant.manifest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, TypeVar

import torch
import torch.nn as nn

from ..json_record import JsonRecord, RecordError, json_field
from ..models.record import QuantizationRecord

__all__ = ["Manifest", "BackendState", "Format", "Written", "QUANTGATE", "OWN_WEIGHTS"]

S = TypeVar("S", bound="BackendState")
OWN_WEIGHTS = "quantized.safetensors"  # quantgate's own layout's weights file


class BackendState(JsonRecord):
    """Base of a backend's saved state (a frozen dataclass): what restoring its models needs beside the scheme
    and the weights (torchao's static int8: the rank of each Linear's inputs). ``of`` reads it off a quantized
    model when it is saved; the handler's ``restore`` gets it back as ``manifest.state``."""

    @classmethod
    def of(cls: type[S], model: nn.Module) -> S:
        raise NotImplementedError(f"{cls.__name__}.of(model): the state of a quantized model, to save")


@dataclass(frozen=True)
class Written:
    """What a format's ``write`` gives ``qg.save``: the ``tensors`` to store, transformers' ``quantization_config``
    for config.json (None: none, and the folder is marked quantgate-only, so other tools refuse it) and the
    format's own ``state`` for the manifest (None: it keeps none)."""

    tensors: Mapping[str, torch.Tensor]
    quantization_config: dict[str, Any] | None = None
    state: JsonRecord | None = None


def _state_dict(model: nn.Module, scheme: object, dtype: torch.dtype | None) -> Written:
    return Written(model.state_dict())


@dataclass(frozen=True)
class Format:
    """A format ``qg.save`` writes a quantized model's weights in: ``write(model, scheme, dtype)`` ->
    :class:`Written`; ``read(model, scheme, tensors, state)`` -> the state dict the restored model loads (None: the
    tensors as stored), ``state`` being the format's saved state (a ``state`` record, or None). ``weights_file``:
    the file's name; ``takes_dtype``: ``qg.save(dtype=...)`` stores the full-precision tensors in another dtype."""

    name: str
    write: Callable[..., Written] = _state_dict
    read: Callable[..., dict[str, torch.Tensor]] | None = None
    weights_file: str = "model.safetensors"
    state: type[JsonRecord] | None = None
    takes_dtype: bool = False


# quantgate's own: the state dict as the model holds it (torchao tensor subclasses flattened with torchao's helpers)
QUANTGATE = Format("quantgate", weights_file=OWN_WEIGHTS)


@dataclass(frozen=True)
class Manifest(QuantizationRecord):
    """quantization.json: the quantization record, then the ``variant`` and ``family``, the ``format`` the weights
    are in, ``aliases`` (tied tensors stored once: alias -> stored name), the backend's ``state`` and the format's
    ``format_state`` (absent where they keep none), the ``weights_file`` and its sha256, the ``stored_dtype`` of a
    format that takes one, the library ``versions`` that saved it and ``content_sha256`` (over the manifest but the
    versions and itself, and config.json: :func:`quantgate.quant.manifest.content_sha256`)."""

    _: KW_ONLY
    variant: str
    family: str
    format: str = QUANTGATE.name
    aliases: dict[str, str]
    state: Any = json_field(omit_none=True)  # a BackendState, typed on reading (:meth:`read`)
    format_state: Any = json_field(omit_none=True)  # the format's state record, typed on reading
    weights_file: str = OWN_WEIGHTS
    stored_dtype: str | None = json_field(omit_none=True)
    weights_sha256: str
    versions: dict[str, str | None] = json_field(default_factory=dict)
    content_sha256: str

    @classmethod
    def of(cls, quantization: QuantizationRecord, **fields: Any) -> Manifest:
        """The manifest starting with the ``quantization`` record, the other ``fields`` given."""
        start = {f.name: getattr(quantization, f.name) for f in dataclasses.fields(QuantizationRecord)}
        return cls(**start, **fields)

    def with_content_sha256(self, content: str) -> Manifest:
        return dataclasses.replace(self, content_sha256=content)

    @classmethod
    def required(cls) -> list[str]:
        """The keys every manifest holds."""
        missing = dataclasses.MISSING
        return [f.name for f in dataclasses.fields(cls) if f.default is missing and f.default_factory is missing]

    @classmethod
    def read(
        cls, data: Mapping[str, Any], state: type[JsonRecord] | None, format_state: type[JsonRecord] | None
    ) -> Manifest:
        """The manifest a JSON object holds, its backend's state read as ``state`` and its format's as
        ``format_state`` (None: the part keeps no state). :class:`RecordError` for a value its field refuses,
        ``InputError`` for an unknown key."""
        data = _older_layout(data, (state, format_state))
        parts: dict[str, Any] = {}
        for key, record in (("state", state), ("format_state", format_state)):
            value = data.get(key)
            if value is None:
                continue
            if record is None:
                raise RecordError(key, "is given, but this backend and format keep no state")
            try:
                parts[key] = record.from_json(value)
            except RecordError as e:
                raise e.within(key) from None
        plain = cls.from_json({k: v for k, v in data.items() if k not in parts})
        return dataclasses.replace(plain, **parts)


def _older_layout(data: Mapping[str, Any], records: tuple[type[JsonRecord] | None, ...]) -> dict[str, Any]:
    """``data`` with the state fields that manifests written before backends owned their state held at their top
    level (every backend's, empty where not its own) moved under ``state`` and ``format_state``."""
    known = {f.metadata.get("key", f.name) for f in dataclasses.fields(Manifest)}
    data = dict(data)
    if "state" in data or "format_state" in data:
        return data
    for key, record in zip(("state", "format_state"), records, strict=True):
        names = {f.metadata.get("key", f.name) for f in dataclasses.fields(record)} if record else set()  # type: ignore[arg-type]  # a record class is a dataclass
        found = {k: data.pop(k) for k in list(data) if k not in known and k in names}
        if found:
            data[key] = found
    for k in [k for k in data if k not in known and data[k] in ({}, [])]:
        del data[k]  # another backend's empty state
    return data
