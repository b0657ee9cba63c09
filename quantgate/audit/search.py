"""The audit's search: whole-model schemes and per-site fallback recipes, each tried on the search documents,
compared on cost, the survivors certified on held-out documents (:mod:`quantgate.certify`).

A candidate's *cost* (:class:`Cost`) is, in this order: the mean bits of its weights over the quantized Linears
(ModelOpt's "effective bits": what the model weighs in memory, what decoding reads per token; 16 for a Linear
kept), the bits its matmuls run at (the mean over those Linears' multiply-adds of max(weight bits, activation
bits): 8 for W8A8, 16 for a weight-only W8A16 or a Linear kept), then the run-time work its activation ranges need
(none for static ranges, reading every token for dynamic ones, extra transforms for online rotations).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

import torch.nn as nn

from ..certify import certifies
from ..data import batches as make_batches
from ..models.families import family_of
from ..quant.quantizers import BLOCK, FP4, FP8
from ..quant.schemes import SimulatedScheme, get_scheme
from ..stats import Delta, TaskDocuments, paired_delta
from ..study.grid import DataSettings
from ..study.steps import quantize_calibrated
from .documents import DocSet
from .record import CurvePoint
from .sites import Sites, can_fall_back, keep_scheme

__all__ = [
    "Rung",
    "LADDER",
    "REFERENCE",
    "Cost",
    "Candidate",
    "Search",
    "Found",
    "scheme_bits",
    "serves",
    "SERVE",
    "Work",
]

if TYPE_CHECKING:
    from ..observe import ObserveReport

log = logging.getLogger("quantgate")


@dataclass(frozen=True)
class Rung:
    """A whole-model scheme the audit tries, and its run-time work in words; a ``probe`` (fewer bits) is tried
    after the 8-bit schemes, where time is left."""

    scheme: str
    bits: str  # weights / activations
    work: str
    probe: bool = False


LADDER: tuple[Rung, ...] = (
    Rung("w8a8-int8-static", "W8A8", "per-tensor static INT8: scales fixed at calibration, nothing read at run time"),
    Rung("w8a8-int8-static:smooth=0.5", "W8A8", "SmoothQuant folded into the weights: static INT8's run time"),
    Rung("w8a8-fp8-e4m3", "W8A8", "per-tensor static FP8 E4M3: static INT8's run time on FP8 hardware"),
    Rung("w8a8-int8-dynamic", "W8A8", "per-token INT8: every token's range read at run time"),
    Rung("w8a8-int8-dynamic:smooth=0.5", "W8A8", "SmoothQuant, then per-token INT8"),
    Rung("w8a8-int8-dynamic:rotate=online", "W8A8", "Hadamard rotations, then per-token INT8: extra transforms"),
    Rung("w8-int8", "W8A16", "weight-only INT8: activations stay 16-bit"),
    Rung("w4a4-nvfp4", "W4A4", "NVFP4 weights and activations (FP4 hardware)", probe=True),
    Rung("w4-int4-group", "W4A16", "weight-only INT4 in groups of 128", probe=True),
)
REFERENCE = LADDER[0].scheme  # the question: per-tensor static INT8


class Work(IntEnum):
    """The run-time work a recipe's activation ranges need, least first."""

    STATIC = 0  # ranges fixed at calibration
    TOKEN = 1  # every token's range read at run time
    ROTATION = 2  # per-token ranges and online Hadamard transforms


RANKING_SEQUENCES = 16  # sequences (of the calibration length, 128 tokens) each site is ranked on


SERVE = ("any", "vllm-cpu")  # where the recipe will run: any engine, or vLLM on a CPU (its kernels, below)


def serves(scheme: str, target: str) -> bool:
    """Whether ``target`` (:data:`SERVE`) has kernels for ``scheme``'s export. vLLM-CPU 0.32 runs compressed-tensors
    W8A8 INT8 (static or dynamic, kept Linears unquantized) and refuses weight-only INT8 ("Failed to find a kernel
    that can implement the WNA16 linear layer"), FP8 and NVFP4 (results/bench/audit-export-vllm-cpu.md,
    shared ECOSYSTEM.md); a rotation is written in quantgate's own format, which no engine reads."""
    if target == "any":
        return True
    s = get_scheme(scheme)
    return (
        isinstance(s, SimulatedScheme)
        and s.rotate == "none"
        and s.weight is not None
        and s.weight.format == "int8"
        and s.act is not None
        and s.act.format == "int8"
    )


def _format_bits(fmt: str) -> int:
    if fmt.startswith("int"):
        return int(fmt[3:])
    return 8 if fmt in FP8 or fmt == "mxfp8" else 4 if fmt in FP4 or fmt in BLOCK else 16


def scheme_bits(scheme: str) -> tuple[int, int, Work]:
    """(weight bits, activation bits, run-time work) of a whole-model scheme: 16 for what it leaves in float;
    a scheme quantgate cannot read the widths of (a torchao or bitsandbytes kernel) counts as W8A8, dynamic."""
    s = get_scheme(scheme)
    if not isinstance(s, SimulatedScheme):
        return 8, 16 if "weight" in s.range_kind() else 8, Work.TOKEN
    w = _format_bits(s.weight.format) if s.weight is not None else 16
    a = _format_bits(s.act.format) if s.act is not None else 16
    work = Work.ROTATION if s.rotate == "online" else Work.TOKEN if s.act is not None and s.act.dynamic else Work.STATIC
    return w, a, work


@dataclass(frozen=True)
class Cost:
    """What a recipe costs (module docstring): bits of its weights and matmuls, run-time work, and the sites it
    keeps in 16-bit with their share of the quantized Linears' weights (= multiply-adds per token)."""

    compute_bits: float
    weight_bits: float
    work: Work
    kept: int = 0
    kept_share: float = 0.0

    def key(self) -> tuple[float, float, int]:
        return round(self.weight_bits, 4), round(self.compute_bits, 4), self.work


@dataclass
class Candidate:
    """A recipe tried: the scheme (with ``keep=`` for a fallback), the whole-model scheme it falls back from, the
    sites kept, its cost, its change on the search and held-out documents, and the seconds it took here."""

    scheme: str
    base: str
    kept: tuple[str, ...]
    cost: Cost
    search: Delta | None = None
    held_out: Delta | None = None
    seconds: float = 0.0
    model: nn.Module | None = field(default=None, repr=False)
    scores: TaskDocuments | None = field(
        default=None, repr=False
    )  # per-document scores on the search set (whole-model)


class Search:
    """One model's search: its float scores on the search set, whole-model candidates, per-site fallbacks."""

    def __init__(self, float_model: nn.Module, tok, calibration: DataSettings, docs: DocSet, tolerance: float,
                 fresh: Callable[[], nn.Module]) -> None:  # fmt: skip
        self.float_model, self.tok, self.calibration = float_model, tok, calibration
        self.docs, self.tolerance, self.fresh = docs, tolerance, fresh
        self.float_docs = docs.score(float_model, tok)
        self.linear_params = {n: m.weight.numel() for n, m in float_model.named_modules() if isinstance(m, nn.Linear)}

    def change(self, model: nn.Module) -> Delta:
        """``model``'s change of perplexity on the search documents, paired with the float model's."""
        return self._change(self.docs.score(model, self.tok))

    def _change(self, scores: TaskDocuments) -> Delta:
        return paired_delta(self.float_docs, scores, self.docs.metric, cluster=self.docs.cluster)

    def quantize(self, scheme: str) -> nn.Module:
        """A fresh copy of the float model quantized with ``scheme`` as a study cell does (seed 0)."""
        return quantize_calibrated(self.fresh(), self.tok, scheme, self.calibration, 0, inplace=True)

    def whole(self, scheme: str) -> Candidate:
        """``scheme`` on the whole model, tried on the search documents; its model kept where its change there is below
        the tolerance (a candidate for the certificate)."""
        start = time.perf_counter()
        model = self.quantize(scheme)
        scores = self.docs.score(model, self.tok)
        d = self._change(scores)
        w, a, work = scheme_bits(scheme)
        c = Candidate(scheme, scheme, (), Cost(max(w, a), w, work), d, seconds=time.perf_counter() - start)
        c.scores = scores
        c.model = model if d.value < self.tolerance else None  # a candidate for the certificate: kept
        return c

    def cost_of(self, base: str, kept: tuple[str, ...], quantized: set[str]) -> Cost:
        """The cost of ``base`` with the sites ``kept`` in 16-bit (``quantized``: the Linears ``base`` quantizes)."""
        w, a, work = scheme_bits(base)
        total = sum(self.linear_params[n] for n in quantized)
        share = sum(self.linear_params[n] for n in kept) / total if total else 0.0
        return Cost(max(w, a) * (1 - share) + 16 * share, w * (1 - share) + 16 * share, work, len(kept), share)

    def ranking_batches(self, sequences: int = RANKING_SEQUENCES) -> list[dict]:
        """One batch of ``sequences`` from the calibration source (another shuffle) to rank sites on: neither search
        nor held-out documents."""
        c = self.calibration
        objective = family_of(self.float_model).objective
        data = make_batches(self.tok, c.data, c.seq_len, sequences, objective, shuffle=True, seed=1, max_batches=1)
        device = next(self.float_model.parameters()).device
        return [{k: v.to(device) for k, v in b.items()} for b in data]


@dataclass
class Fallback:
    """A per-site fallback search on one whole-model scheme: its sites, their ranking (costliest first, and how
    it was ranked), the changes measured at each number of sites kept, the seconds it took."""

    base: str
    sites: Sites
    order: list[str]
    costs: dict[str, float]
    method: str
    tried: dict[int, Delta] = field(default_factory=dict)
    found: dict[float, int | None] = field(default_factory=dict)  # tolerance -> the fewest found (bisection)
    seconds: float = 0.0

    def fewest(self, search: Search, tolerance: float, deadline: float) -> int | None:
        """The fewest sites (top of the ranking) to keep for the change on the search documents to lie wholly below
        ``tolerance``, by bisection (assuming more sites kept never hurts); None where not even all of them
        do, or the time ran out first."""
        if self.found.get(tolerance) is not None:  # bisected before (the curve asks again at the tolerance)
            return self.found[tolerance]
        lo, hi = 0, len(self.order)  # lo: known not within (the whole-model scheme); hi: within (float)
        self.found[tolerance] = None
        if not self._within(hi, search, tolerance):
            return None
        while hi - lo > 1 and time.perf_counter() < deadline:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._within(mid, search, tolerance) else (mid, hi)
        self.found[tolerance] = hi if hi - lo == 1 else None
        return self.found[tolerance]

    def _within(self, k: int, search: Search, tolerance: float) -> bool:
        if k not in self.tried:
            start = time.perf_counter()
            with self.sites.reverted(self.order[:k]):
                self.tried[k] = search.change(self.sites.model)
            self.seconds += time.perf_counter() - start
        return certifies(self.tried[k], tolerance)

    def candidate(self, search: Search, k: int) -> Candidate:
        kept = tuple(self.sites.linear_names(self.order[:k]))
        scheme = keep_scheme(self.base, kept)
        cost = search.cost_of(self.base, kept, set(self.sites.linears))
        return Candidate(scheme, self.base, kept, cost, self.tried[k], seconds=self.seconds)


def fallback(search: Search, base: str, method: str, ranking: Sequence[dict]) -> Fallback:
    """Quantize ``base`` once and rank its sites by ``method`` (:data:`~.sites.RANKINGS`) on ``ranking``."""
    assert can_fall_back(base)
    start = time.perf_counter()
    sites = Sites(search.quantize(base), search.float_model)
    costs = sites.rank(method, ranking)
    order = sorted(costs, key=lambda n: -costs[n])
    return Fallback(base, sites, order, costs, method, seconds=time.perf_counter() - start)


def fresh_copy(model: nn.Module) -> Callable[[], nn.Module]:
    """A maker of fresh copies of ``model`` (deep copies: quantizing one leaves the float model as it is)."""
    return lambda: copy.deepcopy(model)


class Pair(NamedTuple):
    """One whole-model scheme on a pair (the ungated and gated twins, or a baseline and the model given
    ``--against``): each one's change, and the gate's effect, the second's change minus the first's paired over the
    same documents."""

    first: Delta | None
    second: Delta | None
    gap: Delta


@dataclass
class Found:
    """What the search found: every candidate (whole-model and fallback), the fallbacks run, what was cut, on a
    pair each whole-model scheme's :class:`Pair`, the outlier profile."""

    candidates: list[Candidate]
    fallbacks: list[Fallback]
    cut: list[str]
    pairs: dict[str, Pair]
    report: ObserveReport | None
    curve: list[CurvePoint]
