"""Sizing an audit to its budget: this machine's speed, measured on the model, and the documents that fit."""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from .documents import MIN_UNITS, MOST
from .target import AuditError

__all__ = ["parse_budget", "parse_within", "Speed", "measure", "size", "duration", "SAFETY"]

SAFETY = 0.85  # the share of the budget the plan fills: estimates err
MOST_BUDGET_S = (
    30 * 24 * 3600
)  # 720h: a longer budget buys nothing (the sets stop at their largest), a typo more likely
RATIO = 2.0  # a simulated scheme's scoring over the float model's, until one is measured (1.4-2.5 here)
FALLBACK_TRIES = 16  # scorings of the search set a fallback's two bisections take (run.OFFERED; log2 of 120 sites)
CERTIFY = 3  # recipes the certificate may test in turn
RANKING_TOKENS = 2048  # tokens the sites are ranked on (search.RANKING_SEQUENCES of 128)
RANKING_PASSES = 4  # the gradient ranking's cost in forward passes: one with every site quantized beside, a backward


def parse_budget(text: str | float | int) -> float:
    """Seconds in ``text``: ``90s``, ``10m``, ``1h``, ``1h30m`` or a plain number of seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", s)
        if not s or parts is None:
            raise AuditError(f"--budget {text!r}: give a duration such as 90s, 10m or 1h")
        h, m, sec = (float(x) if x else 0.0 for x in parts.groups())
        seconds = 3600 * h + 60 * m + sec
    if not seconds <= MOST_BUDGET_S:  # infinity too (400 digits read as a float), and NaN
        raise AuditError(
            f"--budget {_short(text)}: give a finite duration of at most {MOST_BUDGET_S // 3600}h, such as 90s, 10m "
            f"or 1h (a longer budget reads no more documents: each set stops at its largest)"
        )
    if not seconds > 0:
        raise AuditError(f"--budget {text!r} must be more than 0 seconds")
    return seconds


def _short(text: str | float | int) -> str:
    """``text`` as an error shows it: a long one cut to its first and last digits."""
    s = repr(text) if isinstance(text, str) else str(text)
    return s if len(s) <= 24 else f"{s[:10]}...{s[-10:]} ({len(s) - 2} characters)"


def parse_within(text: str | float) -> float:
    """A tolerance as a fraction of the float perplexity: ``1%`` or ``0.01``."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise AuditError(f"--within {text!r}: give a perplexity change such as 1% or 0.01") from None
    if not 0 < value < 1 or (not s.endswith("%") and value >= 1):
        raise AuditError(f"--within {text!r}: give a change between 0 and 100%, such as 1% or 0.01")
    return value


def duration(seconds: float, up: bool = False) -> str:
    """``90s``, ``4m`` (rounded up to a whole minute with ``up`` above two minutes)."""
    if seconds < 120:
        return f"{int(seconds + 0.999) if up else round(seconds)}s"
    minutes = seconds / 60
    return f"{int(minutes + 0.999) if up else round(minutes)}m"


@dataclass(frozen=True)
class Speed:
    """Seconds per token of a forward pass here, in the audit's dtype and in float32 (the certificate's)."""

    per_token_s: float
    per_token_fp32_s: float


@torch.no_grad()
def _per_token(model: nn.Module, length: int) -> float:
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 1000))
    ids = torch.randint(5, max(vocab - 1, 6), (1, length), device=device)
    times = []
    for _ in range(4):  # the first warms up; the fastest of the others, as other work on the machine only slows
        t0 = time.perf_counter()
        model(input_ids=ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:]) / length


def measure(model: nn.Module, length: int) -> Speed:
    """Time ``model``'s forward pass on one window of ``length`` tokens, in its dtype and in float32."""
    was = model.training
    model.eval()
    try:
        t = _per_token(model, length)
        if next(model.parameters()).dtype == torch.float32:
            return Speed(t, t)
        return Speed(t, _per_token(copy.deepcopy(model).float(), length))
    finally:
        model.train(was)


def size(unit: str, speed: Speed, tokens_per_unit: float, rungs: int, budget_s: float, spent: float,
         units: int | None = None) -> int:  # fmt: skip
    """The most units (passages, or batches) each document set may hold for the search, one fallback and the
    certificate to fit the budget (``units`` where given), for a task whose ``unit`` (its row's) is documents
    (passages) or sequences (batches); refuses a budget in which the fewest that give a
    verdict (:data:`MIN_UNITS`) do not fit, naming the budget that would."""

    def total(n: int) -> float:
        tokens = n * tokens_per_unit
        search = tokens * speed.per_token_s * (1 + RATIO * (rungs + FALLBACK_TRIES))
        ranking = RANKING_TOKENS * speed.per_token_s * RANKING_PASSES
        certify = tokens * speed.per_token_fp32_s * (1 + RATIO * CERTIFY)
        return spent + search + ranking + certify

    least = min(units or MIN_UNITS[unit], MOST[unit])
    if total(least) > budget_s * SAFETY:
        need = total(least) / SAFETY
        raise AuditError(
            f"a budget of {duration(budget_s)} is too small for any interval on this machine: the search and the "
            f"certificate on {least} {'passages' if unit == 'documents' else 'batches'} take about {duration(need)} "
            f"here; give --budget {duration(need, up=True)} or more"
        )
    if units is not None:
        return least
    return max((n for n in range(least, MOST[unit] + 1) if total(n) <= budget_s * SAFETY), default=least)
