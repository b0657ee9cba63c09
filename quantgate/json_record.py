"""Typed records that read and write themselves as JSON: one writer and one reader for every measurement.

A record is a frozen dataclass subclassing :class:`JsonRecord`; its fields are what code reads
(``summary.sink_mass``), and the JSON keys are the field names unless :func:`json_field` names another
key (``"below_0.1"``), leaves a None value out, writes None as a stand-in (``{}``) or keeps a field out of the
JSON altogether (where a record was read from). Fields holding records, lists or dicts of records, or
optional records are converted both ways from the annotations. Reading refuses a key the record does not
know (a renamed or misspelt key fails loudly instead of vanishing) and a missing field without default::

    @dataclass(frozen=True)
    class Unit(JsonRecord):
        mean: float
        below: float = json_field(key="below_0.1")

    Unit.from_json({"mean": 0.5, "below_0.1": 0.2}).below  # 0.2
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from quantgate.errors import InputError

__all__ = ["JsonRecord", "json_field"]

R = TypeVar("R", bound="JsonRecord")


def json_field(
    *,
    key: str | None = None,
    omit_none: bool = False,
    none_as: Any = None,
    stored: bool = True,
    default: Any = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A record field stored under JSON ``key`` (default: the field's name), left out of the JSON when
    ``omit_none`` and its value is None, or written as ``none_as`` then (``{}``; read back as None); not in the
    JSON at all unless ``stored`` (reading refuses it as unknown); ``default`` (or ``default_factory()``): its
    value where the JSON lacks it."""
    metadata = {"key": key, "omit_none": omit_none, "none_as": none_as, "unstored": not stored}
    kept = {k: v for k, v in metadata.items() if v is not None and v is not False}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=kept)
    return dataclasses.field(default=default, metadata=kept)


class JsonRecord:
    """Base of a frozen dataclass that converts to and from a JSON object (see the module docstring)."""

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object: nested records converted, omitted Nones left out."""
        out = {}
        for f in _stored(type(self)):  # type: ignore[arg-type]  # a class is hashable
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[f.metadata.get("key", f.name)] = _to_json(f.metadata.get("none_as") if value is None else value)
        return out

    @classmethod
    def from_json(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record a JSON object holds; ValueError naming an unknown key, TypeError a missing one."""
        if not isinstance(data, Mapping):
            raise InputError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        hints, fields = _hints(cls), _stored(cls)  # type: ignore[arg-type]  # a class is hashable
        keys = {f.metadata.get("key", f.name): f for f in fields}
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise InputError(f"{cls.__name__}: unknown field(s) {unknown} (known: {sorted(keys)})")
        return cls(**{f.name: _read(hints[f.name], f, data[key]) for key, f in keys.items() if key in data})


@cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field annotations, evaluated once."""
    return get_type_hints(cls)


@cache
def _stored(cls: type) -> tuple[dataclasses.Field, ...]:
    """``cls``'s fields that its JSON holds, in order."""
    return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("unstored"))


def _read(tp: Any, f: dataclasses.Field, value: Any) -> Any:
    """Field ``f``'s ``value`` from the JSON: None where it is the field's stand-in for None."""
    if "none_as" in f.metadata and value == f.metadata["none_as"]:
        return None
    return _from_json(tp, value)


def _to_json(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(tp: Any, value: Any) -> Any:
    """``value`` (parsed JSON) as annotation ``tp`` says: records built, containers of records walked."""
    if value is None:
        return None
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _from_json(args[0], value) if len(args) == 1 else value
    if isinstance(tp, type) and issubclass(tp, JsonRecord):
        return tp.from_json(value)
    if origin is list:
        return [_from_json(get_args(tp)[0], v) for v in value]
    if origin is dict:
        return {k: _from_json(get_args(tp)[1], v) for k, v in value.items()}
    return value
