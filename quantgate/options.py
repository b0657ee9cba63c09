"""The ``key=value,...`` part of a spec string (``name:key=value,...``), one parser for attention
variants, quantization schemes and synthetic tasks."""

from __future__ import annotations

from collections.abc import Callable, Iterator


def convert(typ: type, raw: str) -> object:
    """``raw`` as ``typ``: bool from true/false/1/0/yes/no, tuple from ``a|b|c``; ValueError if it is none."""
    if typ is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(raw)
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
    ``owner`` does not take. Raises ValueError naming the item and listing ``valid``."""
    for item in filter(None, (i.strip() for i in arg.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        typ = type_of(key) if eq else None
        if typ is None:
            raise ValueError(f"{owner}: unknown {noun} {item!r}; valid: {valid}")
        try:
            yield key, convert(typ, raw)
        except ValueError:
            raise ValueError(f"{owner}: {key} expects {typ.__name__}, got {raw!r}") from None
