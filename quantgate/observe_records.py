"""What observe measures, as typed records (:mod:`quantgate.json_record`): one tensor's statistics, a layer's,
the model's summary and the run's settings (observe.json), and the compact form a study cell keeps
(metrics.json's ``observe``). Magnitudes are |x| in the activation's units; shares are fractions in [0, 1]. Each
field's range is in its annotation (:data:`~quantgate.json_record.NonNegative`, ``Share``, ``Count``): a record read
back from JSON (observe.json, a study's cached step, metrics.json) refuses a value outside it, naming the field.

Adding a metric: a field here and the line in :mod:`quantgate.observe` that computes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .json_record import Count, JsonRecord, NonNegative, Share, json_field

__all__ = [
    "TopChannel",
    "TensorSummary",
    "UnitSummary",
    "MassiveEntry",
    "NonFinite",
    "LayerHeadline",
    "LayerSummary",
    "Headline",
    "ObserveSummary",
    "ObserveMeta",
    "LayerRow",
    "TopMassive",
    "CellSummary",
    "CellObserve",
]

Counts = list[list]  # [[position or token, count], ...], most common first


@dataclass(frozen=True)
class TopChannel(JsonRecord):
    """A channel that often holds a token's largest |x|: how often (share of tokens) and its max |x|."""

    channel: Count
    share_of_token_max: Share
    max_abs: NonNegative


@dataclass(frozen=True)
class TensorSummary(JsonRecord):
    """One hooked tensor over the data: inf-norm (max |x| per sequence, averaged), kurtosis (per sequence,
    averaged; None where undefined), max and median |x|, and where the sequences' maxima land."""

    inf_norm: NonNegative
    max_abs: NonNegative
    kurtosis: NonNegative | None
    median_abs: NonNegative
    max_median_ratio: NonNegative | None
    sequences: Count
    max_at_token0: Share  # share of sequences whose max |x| is at token 0
    max_positions: Counts
    top_channels: list[TopChannel] | None = json_field(omit_none=True)
    max_tokens: Counts | None = json_field(omit_none=True)
    nonfinite: Count | None = json_field(omit_none=True)  # non-finite elements left out


@dataclass(frozen=True)
class UnitSummary(JsonRecord):
    """Values in [0, 1] (gates, attention on the sink): mean, share below 0.1, per-head means, histogram. A
    ``finetune=true`` gate ranges over [0, 1 / its initial value] (:mod:`quantgate.attention.gates`): means >= 0."""

    mean: NonNegative
    below_0_1: Share = json_field(key="below_0.1", default=0.0)
    per_head: list[NonNegative] = field(default_factory=list)
    hist: list[Share] = field(default_factory=list)  # shares of 20 equal bins over [0, 1]


@dataclass(frozen=True)
class MassiveEntry(JsonRecord):
    """A channel with massive activations (Sun et al.): how many, the largest, where and on which tokens."""

    channel: Count
    count: Count
    max_abs: NonNegative
    positions: Counts
    tokens: Counts


@dataclass(frozen=True)
class NonFinite(JsonRecord):
    """Non-finite elements of one tensor (left out of its statistics)."""

    layer: Count
    tensor: str
    count: Count


@dataclass(frozen=True)
class LayerHeadline(JsonRecord):
    """A block's headline numbers: max inf-norm and mean kurtosis over the reference code's tensors, the
    residual stream's max |x|, mean sink mass and gate value, and its count of massive activations."""

    max_inf_norm: NonNegative
    kurtosis: NonNegative | None
    max_activation: NonNegative
    sink_mass: Share | None
    gate_mean: NonNegative | None
    massive_activations: Count


@dataclass(frozen=True)
class LayerSummary(LayerHeadline):
    """One block: its headline numbers and every hooked tensor's :class:`TensorSummary` by name."""

    tensors: dict[str, TensorSummary]
    sink: UnitSummary | None
    gate: UnitSummary | None
    massive: list[MassiveEntry]

    @property
    def residual(self) -> TensorSummary:
        """The residual stream after the block (the hooked tensor ``block_out``)."""
        return self.tensors["block_out"]


@dataclass(frozen=True)
class Headline(JsonRecord):
    """The model's headline numbers: max inf-norm and mean kurtosis over the reference code's tensors, the
    residual stream's max |x| and max/median, mean sink mass and gate, massive activations, mean loss."""

    max_inf_norm: NonNegative
    kurtosis: NonNegative | None
    max_activation: NonNegative
    max_median_ratio: NonNegative
    sink_mass: Share | None
    gate_mean: NonNegative | None
    gate_below_0_1: Share | None = json_field(key="gate_below_0.1")
    massive_activations: Count = 0
    loss: float | None = None
    tokens: Count = 0
    max_at_token0: Share | None = None  # share of sequences whose max |x| sits at token 0, in the block holding it


@dataclass(frozen=True)
class ObserveSummary(Headline):
    """The headline numbers, the tensors with non-finite elements and the final norm's input and output."""

    nonfinite: list[NonFinite] = field(default_factory=list)
    final_norm_in: TensorSummary | None = json_field(omit_none=True)
    final_norm_out: TensorSummary | None = json_field(omit_none=True)


@dataclass(frozen=True)
class ObserveMeta(JsonRecord):
    """What was observed: model, variant, family, quantization, and the data read."""

    variant: str
    family: str
    sink_tokens: Count
    sequences: Count
    seq_len: Count
    batches: Count
    data: str | None = None
    model: str | None = None
    quantization: str | None = None


@dataclass(frozen=True)
class LayerRow(LayerHeadline):
    """A block's headline numbers as a study cell keeps them, with its residual stream's max/median."""

    max_median_ratio: NonNegative | None

    @classmethod
    def of(cls, layer: LayerSummary) -> LayerRow:
        return cls(**_fields_of(LayerHeadline, layer), max_median_ratio=layer.residual.max_median_ratio)


@dataclass(frozen=True)
class TopMassive(JsonRecord):
    """One of a cell's largest massive activations."""

    layer: Count
    channel: Count
    max_abs: NonNegative
    positions: Counts


@dataclass(frozen=True)
class CellSummary(Headline):
    """The headline numbers as a study cell keeps them: the non-finite count and the 3 largest massive
    activations instead of the per-tensor lists."""

    nonfinite: Count = 0
    top_massive: list[TopMassive] = field(default_factory=list)


@dataclass(frozen=True)
class CellObserve(JsonRecord):
    """A study cell's observe record: the summary and one row per block."""

    summary: CellSummary
    layers: list[LayerRow] = field(default_factory=list)

    @classmethod
    def of(cls, summary: ObserveSummary, layers: list[LayerSummary]) -> CellObserve:
        massive = sorted(((i, e) for i, L in enumerate(layers) for e in L.massive), key=lambda t: -t[1].max_abs)
        top = [TopMassive(i, e.channel, e.max_abs, e.positions) for i, e in massive[:3]]
        compact = CellSummary(**_fields_of(Headline, summary), nonfinite=len(summary.nonfinite), top_massive=top)
        return cls(compact, [LayerRow.of(L) for L in layers])


def _fields_of(base: type, record: JsonRecord) -> dict[str, Any]:
    """The values of ``base``'s fields in ``record`` (an instance of a subclass of ``base``)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(base)}
