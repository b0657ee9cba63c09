"""One kind of table for everything quantgate looks up by name: gate kinds, schemes and their options, scheme
handlers, model families, presets, packaged models and report sections.

A :class:`Registry` is a read-only mapping in registration order with one way in (:meth:`Registry.add`; the
registering decorators ``@gate_kind`` and ``@handles`` call it), which refuses a name given twice, and one way to
look a name up that refuses an unknown one by listing the names it knows (:meth:`Registry.lookup`). A table is
filled by imports a reader can see: its entries live in its own module (``FAMILIES``, ``SCHEMES``, ``GATE_KINDS``
beside the gate classes), or the modules that look entries up import the modules that register them
(``HANDLERS``: quant/__init__.py and export.py import simulate.py and backends.py), never by whatever the package's
``__init__`` happened to import. Tests add an entry inside :meth:`Registry.snapshot`, which puts the table back as
it was.

>>> colours = Registry("colour", {"red": 1})
>>> colours.lookup("blue")
Traceback (most recent call last):
...
quantgate.errors.InputError: unknown colour 'blue'; valid: red
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from .errors import InputError

__all__ = ["Registry"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
E = TypeVar("E")


def _shown(key: object) -> str:
    """A key as an error lists it: a class by its name, anything else as it prints."""
    return getattr(key, "__name__", None) or str(key)


class Registry(Mapping[K, T], Generic[K, T]):
    """The entries of one table, in registration order. ``noun`` names an entry in errors (``unknown {noun}
    'x'; {listing}: a, b``)."""

    def __init__(
        self,
        noun: str,
        entries: Mapping[K, T] | None = None,
        *,
        listing: str = "valid",
    ) -> None:
        self.noun, self.listing = noun, listing
        self._entries: dict[K, T] = {}
        for key, entry in (entries or {}).items():
            self.add(key, entry)

    @classmethod
    def named(cls, noun: str, entries: Iterable[E], *, listing: str = "valid") -> Registry[str, E]:
        """A registry of ``entries`` (objects with a ``name``), each registered under its name, in order."""
        table: Registry[str, E] = Registry(noun, listing=listing)
        for entry in entries:
            table.add(getattr(entry, "name"), entry)  # noqa: B009  (E is any type with a name)
        return table

    def add(self, key: K, entry: T, *, before: K | None = None, after: K | None = None) -> T:
        """Register ``entry`` as ``key``: at the end, or just ``before`` or ``after`` another entry; an
        InputError if ``key`` is registered already (two entries cannot share a name: which was meant cannot
        be known)."""
        if before is not None and after is not None:
            raise InputError(f"{self.noun} {_shown(key)!r}: give before= or after=, not both")
        if key in self._entries:
            raise InputError(f"{self.noun} {_shown(key)!r} is registered twice; give the new one another name")
        beside = before if before is not None else after
        if beside is None:
            self._entries[key] = entry
            return entry
        self.lookup(beside)
        items = list(self._entries.items())
        at = [k for k, _ in items].index(beside) + (after is not None)
        self._entries = dict([*items[:at], (key, entry), *items[at:]])
        return entry

    def lookup(self, key: K) -> T:
        """The entry ``key``; an InputError naming the known ones where there is none."""
        if key not in self._entries:
            known = ", ".join(_shown(k) for k in self._entries)
            raise InputError(f"unknown {self.noun} {_shown(key)!r}; {self.listing}: {known}")
        return self._entries[key]

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Registry[K, T]]:
        """Within the block, entries may be added; afterwards the table is as it was (for tests)."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries = saved

    def __getitem__(self, key: K) -> T:
        return self._entries[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.noun!r}: {', '.join(_shown(k) for k in self)})"
