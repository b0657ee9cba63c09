"""Certifying a recipe: "its change is below the tolerance", with a false-certification rate that holds across
everything a search tried.

A search reads one set of documents and tries many recipes; picking the best-looking one and quoting its interval on
the same documents would certify noise. quantgate certifies on documents the search never read (held-out: other
works), by *fixed-sequence testing*: the recipes whose change on the search's documents is below the tolerance are
ordered before any held-out document is read (by the search documents alone: the audit puts the most confident
first, the lowest upper end), and tested one after another on the held-out documents, each at the full level; the
first that fails ends the sequence. The answer is the cheapest recipe certified. Fixed-sequence testing keeps the
chance of certifying any recipe whose true change is at or above the tolerance at or below the level of one test
(the first such recipe in the order must pass its own test), with no correction for the number tried (Maurer,
Hothorn and Lehmacher 1995; Westfall and Krishen 2001).

One test is the 95% interval's upper end below the tolerance: a one-sided test at 2.5%. Its coverage comes from
:func:`~quantgate.stats.paired_delta` (a cluster interval over works); benchmarks/certify_rate.py measures the
whole procedure's false-certification rate and its power by simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .stats import Delta

__all__ = ["Test", "certifies", "fixed_sequence"]


def certifies(d: Delta | None, tolerance: float) -> bool:
    """Whether ``d`` certifies a change below ``tolerance`` (a fraction): a decisive interval (not approximate)
    whose upper end lies below it."""
    return d is not None and d.decisive and d.high is not None and d.high < tolerance


@dataclass(frozen=True)
class Test:
    """One recipe tested on the held-out documents: its change there and whether it was certified."""

    name: str
    delta: Delta
    certified: bool


def fixed_sequence(order: Sequence[str], measure: Callable[[str], Delta], tolerance: float) -> list[Test]:
    """Test the recipes of ``order`` one after another (``measure(name)``: the recipe's change on the held-out
    documents) until one fails to certify (:func:`certifies`); returns the tests run, in order. The order must be
    fixed before ``measure`` reads any held-out document."""
    tests: list[Test] = []
    for name in order:
        d = measure(name)
        tests.append(Test(name, d, certifies(d, tolerance)))
        if not tests[-1].certified:
            break
    return tests
