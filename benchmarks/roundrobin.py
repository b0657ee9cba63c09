"""Timing that survives a noisy machine: the sides of a comparison take turns, round after round.

A machine that slows down for a while (another job, thermal limits, a malloc storm) slows every side
in the rounds it lasts, so the ratio of two sides *within* a round is steady even when the times are
not. :func:`round_robin` times each side once per round in turn; :func:`ratio` reports the median of
the per-round ratios with their interquartile range.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["round_robin", "ratio", "median_time"]


def round_robin(sides: dict[str, Callable[[int], object]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each side, ``rounds`` rounds after ``warmup`` untimed ones; a side is called
    with the round's index (to pick that round's batch, say)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + rounds):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ratio(times: dict[str, list[float]], side: str, base: str) -> str:
    """``side`` / ``base`` per round: ``"1.42x (IQR 1.38-1.47 over 20 rounds)"``."""
    r = sorted(a / b for a, b in zip(times[side], times[base], strict=True))
    if len(r) < 4:
        return f"{statistics.median(r):.2f}x (range {r[0]:.2f}-{r[-1]:.2f} over {len(r)} rounds)"
    q1, _, q3 = statistics.quantiles(r, n=4)
    return f"{statistics.median(r):.2f}x (IQR {q1:.2f}-{q3:.2f} over {len(r)} rounds)"


def median_time(times: dict[str, list[float]], side: str) -> float:
    return statistics.median(times[side])
