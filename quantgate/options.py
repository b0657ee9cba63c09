"""The ``key=value,...`` part of a spec string (``name:key=value,...``), one parser for attention
variants, quantization schemes and synthetic tasks; the values a setting accepts (:class:`Range`) and the one
option type (:class:`Option`: type, valid values, default) of gates, schemes, tasks, study files and trainer.json,
one definition that the command line, a study file and the Python API all check a value against."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from quantgate.errors import InputError


@dataclass(frozen=True)
class _Interval:
    """The test of :meth:`Range.between`: plain data, so that such a range compares by value and pickles."""

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool

    def __call__(self, x: float) -> bool:
        lo, hi = self.lo, self.hi
        return (lo < x if self.lo_open else lo <= x) and (x < hi if self.hi_open else x <= hi)


@dataclass(frozen=True)
class Range:
    """The values a setting accepts: ``test(value)`` is True for those, and ``wants`` says which in words
    (``">= 1"``, ``"one of a, b"``), as an error shows them. Numeric intervals come from :meth:`between`. A value
    is ``in`` the range where the test accepts it; a float must also be finite, and a value of another type (a
    string where a number belongs) is not in it."""

    test: Callable[[Any], bool]
    wants: str

    @classmethod
    def between(
        cls, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
    ) -> Range:
        """The numbers from ``lo`` to ``hi``, each end closed unless ``*_open`` (``>= 1``, ``in (50, 100]``)."""
        if hi == math.inf:
            wants = f"{'>' if lo_open else '>='} {_bound(lo)}"
        elif lo == -math.inf:
            wants = f"{'<' if hi_open else '<='} {_bound(hi)}"
        else:
            wants = f"in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"
        return cls(_Interval(lo, hi, lo_open, hi_open), wants)

    def __contains__(self, value: object) -> bool:
        if not _finite(value):
            return False
        try:
            return bool(self.test(value))
        except TypeError:  # a value of another type ("5" where a number belongs)
            return False

    def check(self, owner: str, name: str, value: float) -> None:
        """An InputError ``owner: name must be WANTS, got VALUE`` unless ``value`` is finite and in the range
        (the form a spec string's parameter is refused in)."""
        if not math.isfinite(value):
            raise InputError(f"{owner}: {name} must be a finite number, got {value}")
        if value not in self:
            raise InputError(f"{owner}: {name} must be {self.wants}, got {value:g}")

    def __str__(self) -> str:
        return self.wants


@dataclass(frozen=True)
class Option:
    """A setting given by name (a gate's, a scheme's, a synthetic task's, a study file's key, a trainer.json
    field): its ``type`` (a class, or a type hint such as ``list[str]``), the values it accepts (``valid``: a
    tuple of choices, a :class:`Range`, or None: any value of the type) and its ``default`` (None: unset)."""

    type: Any
    valid: tuple | Range | None = None
    default: object = None

    def accepts(self, value: object) -> bool:
        """Whether ``value`` (already of the option's type) is one it takes; a float must also be finite."""
        return _finite(value) and (self.valid is None or value in self.valid)

    @property
    def wants(self) -> str:
        """The values it takes, in words: a range's words, ``one of a, b``, or ``""`` (any)."""
        if self.valid is None or isinstance(self.valid, Range):
            return str(self.valid or "")
        return f"one of {', '.join(printed(v) for v in self.valid)}"

    def check(self, owner: str, key: str, value: object) -> None:
        """An InputError ``owner: key must be WANTS, got VALUE`` unless the option takes ``value``."""
        if isinstance(self.valid, Range):
            assert isinstance(value, (int, float))  # a Range bounds an int or float option
            self.valid.check(owner, key, value)
        elif not self.accepts(value):
            raise InputError(f"{owner}: {key} must be {self.wants}, got {value!r}")


def _bound(x: float) -> str:
    """An end of a range as its words give it: ``1``, ``0.5``; a whole number in full (4294967295, not 4.29e+09)."""
    return str(int(x)) if isinstance(x, int) or (math.isfinite(x) and x.is_integer() and abs(x) >= 1e6) else f"{x:g}"


AT_LEAST_1 = Range.between(1)
AT_LEAST_0 = Range.between(0)
ABOVE_0 = Range.between(0, lo_open=True)
# Every seed a run takes (a study's seed:, a model's seeds:, train's seed, train --seed): the range of the narrowest
# generator a run seeds, numpy's legacy one (accelerate's set_seed), 2**32 - 1 at most; torch takes up to 2**64 - 1
SEED = Range.between(0, 2**32 - 1)


def _finite(value: object) -> bool:
    """False for a float NaN or infinity, True for anything else."""
    return not isinstance(value, float) or math.isfinite(value)


def in_range(value: object, valid: Range | None) -> bool:
    """Whether ``value`` is one ``valid`` accepts (None: any finite value)."""
    return _finite(value) if valid is None else value in valid


def check_range(name: str, value: object, valid: Range | None) -> None:
    """A one-line ValueError ``NAME must be WANTS; got VALUE`` unless ``value`` is None (the default) or
    :func:`in_range`."""
    if value is not None and not in_range(value, valid):
        raise InputError(f"{name} must be {valid.wants if valid else 'finite'}; got {value!r}")


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
            value = convert(typ, raw)
        except ValueError:  # int() or float() of text that is no number (InputError is one: not a truth value)
            raise InputError(f"{owner}: {key} expects {typ.__name__}, got {raw!r}") from None
        yield key, value
