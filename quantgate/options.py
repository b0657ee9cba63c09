"""The ``key=value,...`` part of a spec string (``name:key=value,...``), one parser for attention
variants, quantization schemes and synthetic tasks; and the ranges of settings (:data:`Range`), one
definition that the command line, a study file and the Python API all check a value against."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from quantgate.errors import InputError

Range = tuple[Callable[[Any], bool], str]  # (test, what it wants): the values a setting accepts
AT_LEAST_1: Range = (lambda x: x >= 1, ">= 1")
AT_LEAST_0: Range = (lambda x: x >= 0, ">= 0")
ABOVE_0: Range = (lambda x: x > 0, "> 0")


def in_range(value: object, valid: Range | None) -> bool:
    """Whether ``value`` is one ``valid`` accepts (None: any); a float must also be finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    try:
        return valid is None or bool(valid[0](value))
    except TypeError:  # a value of another type ("5" where a number belongs)
        return False


def check_range(name: str, value: object, valid: Range | None) -> None:
    """A one-line ValueError ``NAME must be WANTS; got VALUE`` unless ``value`` is None (the default) or
    :func:`in_range`."""
    if value is not None and not in_range(value, valid):
        raise InputError(f"{name} must be {valid[1] if valid else 'finite'}; got {value!r}")


def convert(typ: type, raw: str) -> object:
    """``raw`` as ``typ``: bool from true/false/1/0/yes/no, tuple from ``a|b|c``; ValueError if it is none."""
    if typ is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise InputError(raw)
    if typ is tuple:
        return tuple(p for p in raw.split("|") if p)
    return typ(raw)


def printed(value: object) -> str:
    """``value`` as a spec string writes it, the inverse of :func:`convert`: true/false, ``a|b|c``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "|".join(value)
    return str(value)


def key_values(
    owner: str, arg: str, type_of: Callable[[str], type | None], *, valid: str, noun: str = "option"
) -> Iterator[tuple[str, object]]:
    """(key, converted value) for each ``key=value`` of ``arg``; ``type_of(key)`` is None for a key
    ``owner`` does not take. Raises ValueError naming the item and listing ``valid``, and on a key given
    twice (which value was meant cannot be known)."""
    seen: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in arg.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        typ = type_of(key) if eq else None
        if typ is None:
            raise InputError(f"{owner}: unknown {noun} {item!r}; valid: {valid}")
        if key in seen:
            raise InputError(f"{owner}: {key} is given twice ({seen[key]!r} and {raw!r}); give it once")
        seen[key] = raw
        try:
            yield key, convert(typ, raw)
        except ValueError:
            raise InputError(f"{owner}: {key} expects {typ.__name__}, got {raw!r}") from None
