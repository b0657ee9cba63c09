"""audit.json: what an audit tried and found, as one typed record (its writer and reader). Reading it back
(:meth:`AuditRecord.read`) checks every field, its type and range (a tolerance in (0, 1), counts, durations), and
refuses a key the record does not have (the audit keeps no plan in it: ``docs`` or ``estimate_s`` there are
refused, never used); an audit run plans from its options alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from ..errors import InputError
from ..files import read_json
from ..json_record import Count, Finite, JsonRecord, NonNegative, Share
from ..options import Range
from ..stats import Delta

__all__ = ["ChangeRecord", "CandidateRecord", "CurvePoint", "PairRecord", "AuditRecord"]

Tolerance = Annotated[float, Range.between(0, 1, lo_open=True, hi_open=True)]  # a perplexity change, as --within
Positive = Annotated[float, Range.between(0, lo_open=True)]


@dataclass(frozen=True)
class ChangeRecord(JsonRecord):
    """A perplexity change (a fraction) with its 95% interval, over ``n`` documents in ``clusters`` units."""

    value: Finite
    low: Finite | None
    high: Finite | None
    n: Count
    clusters: Count | None
    approximate: bool
    method: str

    @classmethod
    def of(cls, d: Delta | None) -> ChangeRecord | None:
        if d is None:
            return None
        return cls(d.value, d.low, d.high, d.n, d.clusters, d.approximate, d.method)

    def delta(self, kind: str = "perplexity") -> Delta:
        """The change back as a :class:`~quantgate.stats.Delta` of ``kind`` (a record keeps no kind: its reader
        knows it)."""
        return Delta(self.value, self.low, self.high, kind, self.n, self.method, self.clusters, self.approximate)


@dataclass(frozen=True)
class CandidateRecord(JsonRecord):
    """One recipe tried: its scheme, the whole-model scheme it falls back from, the sites it keeps in 16-bit, its
    cost (bits of its weights and matmuls, run-time work rank, share of the quantized Linears' weights kept), its
    change on the search and held-out documents and whether the certificate holds, the seconds it took here."""

    scheme: str
    base: str
    kept: list[str]
    compute_bits: Positive
    weight_bits: Positive
    work: Count
    kept_share: Share
    search: ChangeRecord | None
    held_out: ChangeRecord | None = None
    certified: bool = False
    seconds: NonNegative = 0.0


@dataclass(frozen=True)
class CurvePoint(JsonRecord):
    """The fewest sites of a scheme kept in 16-bit for its change on the search documents to lie below a
    tolerance (None: not found in the time), and that change."""

    tolerance: Tolerance
    kept: Count | None
    change: ChangeRecord | None


@dataclass(frozen=True)
class PairRecord(JsonRecord):
    """One whole-model scheme on a pair (a baseline first, the gated model second): each one's change, the gated
    one's change minus the baseline's paired over the same documents (``kind`` "points": a difference of
    fractions; "ratio": the ratio of the two perplexity ratios, minus 1), and the share of the baseline's change
    the gated model does not have (1 - gated / baseline; None where the baseline's change is not above 0)."""

    scheme: str
    baseline: ChangeRecord | None
    gated: ChangeRecord | None
    difference: ChangeRecord | None
    kind: str
    share_removed: Finite | None


@dataclass(frozen=True)
class AuditRecord(JsonRecord):
    """An audit: the question (model, dtype, tolerance, budget), the two document sets in words, every candidate
    tried, the certification order, the recipe (None: none certified), the fallback's site ranking and curve; on
    a pair, the model compared and each scheme's changes (:class:`PairRecord`)."""

    model: str
    dtype: str
    tolerance: Tolerance
    budget_s: Positive
    seconds: NonNegative
    search_documents: str
    held_out_documents: str
    candidates: list[CandidateRecord]
    order: list[str]
    recipe: str | None
    ranking: str | None = None
    ranked_sites: list[str] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)
    serve: str = "any"  # the serving target: recipes it has no kernels for are not certified
    against: str | None = None  # the gated model compared with the audited one (--against), None: none or a twin
    pair: list[PairRecord] = field(default_factory=list)  # on a pair, per whole-model scheme

    @classmethod
    def read(cls, path: str | Path) -> AuditRecord:
        """The record in audit.json ``path``; a one-line InputError naming the file and the field where it cannot
        be read, a field is of another type or out of range, or a key is not the record's."""
        fix = "run the audit again (quantgate audit MODEL --out DIR) or restore the file"
        data = read_json(path, fix=fix)
        try:
            return cls.from_json(data)
        except (InputError, TypeError) as e:  # TypeError: a field missing
            raise InputError(f"cannot read {path}: {e}; {fix}") from None
