"""Typed records that read and write themselves as JSON: one writer and one reader for every measurement.

A record is a frozen dataclass subclassing :class:`JsonRecord`; its fields are what code reads
(``summary.sink_mass``), and the JSON keys are the field names unless :func:`json_field` names another
key (``"below_0.1"``), leaves a None value out, writes None as a stand-in (``{}``) or keeps a field out of the
JSON altogether (where a record was read from). Fields holding records, lists or dicts of records, or
optional records are converted both ways from the annotations. Reading refuses a key the record does not
know (a renamed or misspelt key fails loudly instead of vanishing) and a missing field without default. Every
value read is checked against its annotation: a number where ``float`` or ``int`` stands (no ``true``, no text), a
string for ``str``, an array for ``list``, an object for ``dict`` and a record, and where the annotation carries a
:class:`~quantgate.options.Range` (``Annotated[float, AT_LEAST_0]``: :data:`NonNegative`, :data:`Share`,
:data:`Count`, :data:`Finite`) a finite value in it; null only where the annotation takes None (``float | None``). A
value that is not is a :class:`RecordError` naming the field's path (``cells[0].observe.summary.kurtosis is 'abc',
not a finite number >= 0``), which the reader of a file prefixes with the file::

    @dataclass(frozen=True)
    class Unit(JsonRecord):
        mean: Share
        below: float = json_field(key="below_0.1")

    Unit.from_json({"mean": 0.5, "below_0.1": 0.2}).below  # 0.2
    Unit.from_json({"mean": 5})  # RecordError: mean is 5, not a finite number in [0, 1]

A *view* (``class V(JsonRecord, view=True)``) reads its fields of an object that holds more and passes the other
keys over: what a reader takes, typed, of data kept as it was written (metrics.json's ``study``, the study file as
it ran); a view is read, never written.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Annotated, Any, ClassVar, TypeVar, get_args, get_origin, get_type_hints

from quantgate.errors import InputError
from quantgate.options import AT_LEAST_0, Range

__all__ = ["JsonRecord", "json_field", "RecordError", "NonNegative", "Share", "Count", "Finite"]

R = TypeVar("R", bound="JsonRecord")

# the annotations of a field whose values have a range (any float in the JSON read as a finite one in it)
NonNegative = Annotated[float, AT_LEAST_0]  # magnitudes |x|, ratios of them, durations in seconds
Share = Annotated[float, Range.between(0, 1)]  # fractions: attention on a token, shares of sequences or of bins
Count = Annotated[int, AT_LEAST_0]  # whole numbers >= 0: counts, indices of layers and channels, steps
Finite = Annotated[float, Range(math.isfinite, "")]  # any finite number


class RecordError(InputError):
    """A value of a record's JSON that its field's annotation refuses: ``at``, the field's path from the record read
    (``cells[0].observe.summary.kurtosis``), and ``problem`` (``is 'abc', not a finite number >= 0``)."""

    def __init__(self, at: str, problem: str) -> None:
        super().__init__(f"{at} {problem}")
        self.at, self.problem = at, problem

    def within(self, outer: str) -> RecordError:
        """The same error, its path under ``outer`` (the field holding the record it was found in)."""
        inner = self.at if self.at.startswith("[") else f".{self.at}"
        return RecordError(f"{outer}{inner}" if outer else self.at, self.problem)


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

    _view: ClassVar[bool] = False  # a view: reads its fields of a larger object, passing the other keys over

    def __init_subclass__(cls, view: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._view = view

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
        """The record a JSON object holds; an InputError naming an unknown key (a view passes them over),
        :class:`RecordError` a missing one or a value its field refuses."""
        if not isinstance(data, Mapping):
            raise InputError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        hints, fields = _hints(cls), _stored(cls)  # type: ignore[arg-type]  # a class is hashable
        keys = {f.metadata.get("key", f.name): f for f in fields}
        unknown = [] if cls._view else sorted(set(data) - set(keys))
        if unknown:
            raise InputError(f"{cls.__name__}: unknown field(s) {unknown} (known: {sorted(keys)})")
        unset = dataclasses.MISSING
        missing = [k for k, f in keys.items() if k not in data and f.default is unset and f.default_factory is unset]
        if missing:
            raise RecordError(missing[0], "is missing")
        return cls(**{f.name: _read(hints[f.name], f, data[key], key) for key, f in keys.items() if key in data})


@cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field annotations, evaluated once (with their ranges: ``Annotated``)."""
    return get_type_hints(cls, include_extras=True)


@cache
def _stored(cls: type) -> tuple[dataclasses.Field, ...]:
    """``cls``'s fields that its JSON holds, in order."""
    return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("unstored"))


def _read(tp: Any, f: dataclasses.Field, value: Any, at: str) -> Any:
    """Field ``f``'s ``value`` from the JSON (under key ``at``): None where it is the field's stand-in for None."""
    if "none_as" in f.metadata and value == f.metadata["none_as"]:
        return None
    return _from_json(tp, value, at)


def _to_json(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(tp: Any, value: Any, at: str = "") -> Any:
    """``value`` (parsed JSON, at path ``at``) as annotation ``tp`` says: checked against its type and range,
    records built, containers walked; a :class:`RecordError` naming the path where it is not what ``tp`` says (null
    too, unless ``tp`` takes None)."""
    if value is None:
        if _takes_none(tp):
            return None
        raise RecordError(at, f"is null, not {_noun(tp)}")
    origin = get_origin(tp)
    if origin is Annotated:
        base, *ranges = get_args(tp)
        valid = [r for r in ranges if isinstance(r, Range)]
        wants = _noun(base, finite=bool(valid)) + "".join(f" {r}" for r in valid if str(r))
        try:
            read = _from_json(base, value, at)
        except RecordError as e:
            if e.at != at:  # inside the value (an item of a list)
                raise
            read = None
        if read is None or any(read not in r for r in valid):
            raise RecordError(at, f"is {value!r}, not {wants}")
        return read
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _from_json(args[0], value, at)
        for a in args:  # the first that takes it
            try:
                return _from_json(a, value, at)
            except RecordError:
                continue
        raise RecordError(at, f"is {value!r}, not {' or '.join(_noun(a) for a in args)}")
    if isinstance(tp, type) and issubclass(tp, JsonRecord):
        if isinstance(value, tp):  # a record already (a result computed in memory): as it is
            return value
        if not isinstance(value, Mapping):
            raise RecordError(at, f"is a JSON {_kind(value)}, not an object")
        try:
            return tp.from_json(value)
        except RecordError as e:
            raise e.within(at) from None
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise RecordError(at, f"is a JSON {_kind(value)}, not an array")
        item = get_args(tp)[0] if get_args(tp) else Any
        return [_from_json(item, v, f"{at}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecordError(at, f"is a JSON {_kind(value)}, not an object")
        item = get_args(tp)[1] if get_args(tp) else Any
        return {k: _from_json(item, v, f"{at}.{k}") for k, v in value.items()}
    if tp in (float, int, str, bool) and not _is(tp, value):
        raise RecordError(at, f"is {value!r}, not {_noun(tp)}")
    return value


def _takes_none(tp: Any) -> bool:
    """Whether annotation ``tp`` takes None (JSON null): ``Any``, or a union with None (``float | None``)."""
    if get_origin(tp) is Annotated:
        return _takes_none(get_args(tp)[0])
    if get_origin(tp) in (typing.Union, types.UnionType):
        return type(None) in get_args(tp)
    return tp is Any


def _is(tp: type, value: Any) -> bool:
    """Whether ``value`` is a ``tp`` (float: any real number; int: a whole one; neither a boolean; numpy's numbers
    too, for records built from computed values)."""
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real)
    if tp is int:
        return isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())
    return isinstance(value, tp)


def _noun(tp: Any, finite: bool = False) -> str:
    """What a value of annotation ``tp`` is, in words (``a finite number``)."""
    base = get_args(tp)[0] if get_origin(tp) is Annotated else tp
    if base is float:
        return "a finite number" if finite or base is not tp else "a number"
    words = {int: "a whole number", str: "a string", bool: "true or false", list: "an array", dict: "an object"}
    return words.get(get_origin(base) or base, "a JSON object" if isinstance(base, type) else str(base))


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value (``string``, ``array``, ...)."""
    kinds = {str: "string", list: "array", dict: "object", bool: "boolean", int: "number", float: "number"}
    return next((name for t, name in kinds.items() if isinstance(value, t)), type(value).__name__)
