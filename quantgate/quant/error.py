"""Where quantization hurts: per-layer SQNR of a quantized model against its float source (:class:`QuantError`),
and the loss each activation quantizer costs on its own (:class:`SiteSensitivity`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import InputError
from ..json_record import Count, JsonRecord
from ..models.families import family_of
from ..models.modes import eval_mode
from ..stats import TaskDocuments, paired_delta
from .simulate import ActQuant, act_quantizers

__all__ = [
    "quant_error",
    "QuantError",
    "LayerError",
    "QuantizerError",
    "float_outputs",
    "FloatOutputs",
    "site_sensitivity",
    "SiteSensitivity",
    "SiteCost",
    "PplChange",
    "sqnr_db",
]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal energy / noise energy); inf when the noise is zero."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@dataclass(frozen=True)
class LayerError(JsonRecord):
    """A block of a quantized model against the float model: its index (``layer``) and the SQNR of its output
    (``sqnr_db``, dB; inf where the outputs are equal)."""

    layer: Count
    sqnr_db: float


@dataclass(frozen=True)
class QuantizerError(JsonRecord):
    """An activation quantizer of a simulated scheme: its ``name``, the SQNR of the tensor it quantizes
    (``sqnr_db``, dB), and of its ``values`` quantized, those FP8 saturated at the format's limit (``overflow``)."""

    name: str
    sqnr_db: float
    overflow: Count
    values: Count


@dataclass(frozen=True)
class QuantError(JsonRecord):
    """:func:`quant_error`'s report over ``batches`` batches: each block's error (``layers``, in order), the
    logits' SQNR (``logits_sqnr_db``, dB) and each activation quantizer's error (``quantizers``, lowest SQNR first;
    none for a scheme without them)."""

    layers: list[LayerError]
    logits_sqnr_db: float
    quantizers: list[QuantizerError]
    batches: Count

    @property
    def worst_layers(self) -> list[LayerError]:
        """The three blocks with the lowest SQNR, lowest first."""
        return sorted(self.layers, key=lambda r: r.sqnr_db)[:3]

    @property
    def overflow(self) -> int:
        """The values FP8 saturated, over every quantizer."""
        return sum(q.overflow for q in self.quantizers)


@dataclass(frozen=True)
class PplChange(JsonRecord):
    """A change of perplexity (``ppl_change``: the ratio - 1) and its 95% paired bootstrap interval over the
    sequences (``low``, ``high``; None where there is none)."""

    ppl_change: float
    low: float | None
    high: float | None


@dataclass(frozen=True)
class SiteCost(JsonRecord):
    """What one activation quantizer (``name``) costs alone: the perplexity change against every quantizer off
    (``ppl_change``, ``low``, ``high``: :class:`PplChange`'s), the SQNR of its tensor with all on (``sqnr_db``, dB) and
    its static range (``lo``, ``hi``; None where it is dynamic)."""

    name: str
    ppl_change: float
    low: float | None
    high: float | None
    sqnr_db: float
    lo: float | None
    hi: float | None


@dataclass(frozen=True)
class SiteSensitivity(JsonRecord):
    """:func:`site_sensitivity`'s report: the mean loss (nats per predicted token) with every quantizer off
    (``none``) and on (``all``), the change all on (``all_change``) and each site alone (``sites``, costliest
    first)."""

    none: float
    all: float
    all_change: PplChange
    sites: list[SiteCost]


@dataclass
class FloatOutputs:
    """A float model's outputs on some batches (float32, on the CPU), kept to compare a quantized model against
    where the float model is gone (quantized in place): per batch, its inputs, each block's output and the
    logits."""

    inputs: list[dict[str, torch.Tensor]]
    blocks: list[list[torch.Tensor]]
    logits: list[torch.Tensor]


@torch.no_grad()
def float_outputs(
    fp_model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, max_batches: int | None = 4
) -> FloatOutputs:
    """Run ``fp_model`` on the first ``max_batches`` of ``batches`` (all with None) and keep its outputs."""
    inputs = [{k: v for k, v in b.items() if k != "labels"} for b in itertools.islice(batches, max_batches)]
    if not inputs:
        raise InputError("quant_error got no batches")
    runs = [_outputs(fp_model, x) for x in inputs]
    return FloatOutputs(inputs, [blocks for blocks, _ in runs], [logits for _, logits in runs])


def _outputs(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block's output and the logits of ``model`` on ``inputs`` (float32, on the CPU)."""
    blocks: list[torch.Tensor] = []
    hooks = [
        block.register_forward_hook(
            lambda m, a, o: blocks.append((o[0] if isinstance(o, tuple) else o).detach().float().cpu())
        )
        for block in family_of(model).blocks(model)
    ]
    try:
        with eval_mode(model):
            logits = model(**{k: v.to(_device(model)) for k, v in inputs.items()}).logits.float().cpu()
    finally:
        for h in hooks:
            h.remove()
    return blocks, logits


@torch.no_grad()
def quant_error(
    fp: nn.Module | FloatOutputs,
    q_model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]] = (),
    *,
    max_batches: int | None = 4,
) -> QuantError:
    """Run both models on the same batches and report the SQNR (dB) of every block's output, of the
    logits and, for simulated schemes, of every activation quantizer (with FP8 saturation counts).
    ``worst_layers`` lists the three blocks with the lowest SQNR. ``fp``: the float model, or its outputs
    kept by :func:`float_outputs` (then on the batches they were computed on; ``batches`` is not read)."""
    reference = fp if isinstance(fp, FloatOutputs) else float_outputs(fp, batches, max_batches=max_batches)
    quantizers = {n: m for n, m in q_model.named_modules() if m in set(act_quantizers(q_model))}
    for q in quantizers.values():
        q.track, q.signal, q.noise, q.overflow, q.values = True, 0.0, 0.0, 0, 0
    n_layers = len(reference.blocks[0])
    energy = [[0.0, 0.0] for _ in range(n_layers + 1)]  # blocks, then logits
    try:
        for inputs, ref_blocks, ref in zip(reference.inputs, reference.blocks, reference.logits, strict=True):
            blocks, got = _outputs(q_model, inputs)
            for layer, (a, b) in enumerate(zip(ref_blocks, blocks, strict=True)):
                energy[layer][0] += float(a.double().square().sum())
                energy[layer][1] += float((a.double() - b.double()).square().sum())
            energy[-1][0] += float(ref.double().square().sum())
            energy[-1][1] += float((ref.double() - got.double()).square().sum())
    finally:
        for q in quantizers.values():
            q.track = False
    quant = [QuantizerError(n, sqnr_db(q.signal, q.noise), q.overflow, q.values) for n, q in quantizers.items()]
    return QuantError(
        layers=[LayerError(i, sqnr_db(*energy[i])) for i in range(n_layers)],
        logits_sqnr_db=sqnr_db(*energy[-1]),
        quantizers=sorted(quant, key=lambda r: r.sqnr_db),
        batches=len(reference.inputs),
    )


@torch.no_grad()
def site_sensitivity(
    q_model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, max_batches: int = 2
) -> SiteSensitivity:
    """Which activation quantizer of a simulated scheme costs what. On the batches (they carry ``labels``),
    each sequence's summed NLL with every quantizer off (weights stay as quantized), with all on, and with
    each alone on (:class:`SiteSensitivity`: the mean losses, the change all on and each site's alone,
    costliest first). Interactions are not additive: the alone changes need not compose to the all-on
    change."""
    quantizers = act_quantizers(q_model)
    if not quantizers:
        raise InputError(
            "site_sensitivity needs a model quantized by a simulated scheme with activation "
            "quantizers (e.g. w16a8-int8-bondarenko); this one has none"
        )
    data = [{k: v.to(_device(q_model)) for k, v in b.items()} for b in itertools.islice(batches, max_batches)]
    if not data or any("labels" not in b for b in data):
        raise InputError("site_sensitivity needs batches with labels (quantgate.data.batches gives them)")
    shift = int(family_of(q_model).objective == "clm")  # a causal LM predicts the next token's label
    labels = torch.cat([b["labels"][:, shift:] for b in data])
    tokens = (labels != -100).sum(1).tolist()

    def documents(on) -> TaskDocuments:
        for q in quantizers:
            q.enabled = q in on
        per_batch = []
        for b in data:
            logits = q_model(**{k: v for k, v in b.items() if k != "labels"}).logits
            logits = logits[:, : logits.shape[1] - shift].float()
            ce = nn.functional.cross_entropy(logits.transpose(1, 2), b["labels"][:, shift:], reduction="none")
            per_batch.append(ce.sum(1).double())
        nll = torch.cat(per_batch)
        if not torch.isfinite(nll).all():
            raise InputError(
                f"site_sensitivity: the loss is not finite with {len(on)} of {len(quantizers)} "
                f"quantizers on ({', '.join(sorted(q.name for q in on)[:3]) or 'none'}); check the "
                f"model's weights and the quantizers' ranges (quant.simulate.check_ranges)"
            )
        values = nll.tolist()
        return TaskDocuments(ids=list(range(len(values))), loglikelihood=[-x for x in values], tokens=tokens)

    def change(base: TaskDocuments, new: TaskDocuments) -> PplChange:
        d = paired_delta(base, new, "perplexity")
        return PplChange(d.value, d.low, d.high)

    def cost(q: ActQuant, alone: PplChange) -> SiteCost:
        lo, hi = (None, None) if q.spec.dynamic else (float(q.lo.min()), float(q.hi.max()))
        return SiteCost(q.name, alone.ppl_change, alone.low, alone.high, sqnr_db(q.signal, q.noise), lo, hi)

    def mean_loss(docs: TaskDocuments) -> float:
        return -sum(docs.loglikelihood or ()) / sum(tokens)

    with eval_mode(q_model):
        try:
            for q in quantizers:
                q.track, q.signal, q.noise = True, 0.0, 0.0
            everything = documents(set(quantizers))
            for q in quantizers:
                q.track = False
            none = documents(set())
            rows = [cost(q, change(none, documents({q}))) for q in quantizers]
        finally:
            for q in quantizers:
                q.enabled, q.track = True, False
    return SiteSensitivity(
        none=mean_loss(none),
        all=mean_loss(everything),
        all_change=change(none, everything),
        sites=sorted(rows, key=lambda r: -r.ppl_change),
    )


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
