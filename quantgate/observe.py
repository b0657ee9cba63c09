"""Observe: stream outlier, sink and gate statistics over a dataset in bounded memory.

``qg.observe(model, batches)`` runs the model over the batches with forward hooks that fold every
activation into running statistics and then drop it, so memory does not grow with the dataset and
stays close to a plain forward pass at long context: a hook keeps no tensor alive, folds it in chunks
of tokens, and without labels the LM head (full-vocabulary logits) does not run. The attention mass
on the first keys comes from gated_sdpa's log-sum-exp path, never from an N x N probability matrix.
Tensors are measured per token wherever a token axis can be found (see ``_by_token``; padding is left
out); one without (none in the supported families) is measured whole, as one sequence. Per block it
measures:

* tensors: the residual stream after the block (``block_out``), the attention output before and
  after the output projection (``attn_pre_o``, ``attn_out``), the FFN output (``ffn_out``), the
  input and output of every LayerNorm/RMSNorm (``norm_in.<path>``, ``norm_out.<path>``) and the input
  of every Linear (``linear_in.<path>``): infinity norm (Bondarenko et al.: max |x| per sequence,
  averaged over sequences), kurtosis (mu4 / sigma^4, non-excess, per sequence over the flattened
  T x d tensor, averaged), max |x|, median |x| (from a 0.01-decade log histogram), the channels
  that most often hold a token's largest |x|, and the token positions (and token ids) where each sequence's max lands;
* massive activations in the residual stream (Sun et al.: |x| > 100 and > 1000 x the sequence's
  median |x|), with channel, position and token;
* attention mass on the first ``sink_tokens`` keys per head (queries that can only see those keys
  and padded queries are left out), its mean and histogram;
* gate values for gated variants (also Qwen3-Next's built-in gate): mean, fraction below 0.1,
  histogram, per head.

The headline max inf-norm and kurtosis are taken over the tensors Bondarenko et al.'s reference code
(Qualcomm-AI-research/outlier-free-transformers) hooks, see :func:`paper_tensors`: for BERT
(validate_mlm.py) each layer's FFN output and the LayerNorm after it, whose input (the residual sum)
joins the inf-norm only; for decoders (run_clm.py's OPT list) each block's output, attention output,
FFN output and the outputs of its two norms, plus the final norm's output. Each tensor's per-sequence
values are averaged over sequences, then the kurtosis over those tensors and the inf-norm's maximum.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .errors import InputError
from .files import write_text_atomic
from .json_record import JsonRecord
from .massive import Decode, MassiveActivations
from .models.families import Family, config_of, family_of, is_norm
from .models.modes import eval_mode
from .models.swap import VariantAttention, apply_variant, attention_modules, variant_of
from .observe_records import (
    LayerSummary,
    NonFinite,
    ObserveMeta,
    ObserveSummary,
    TensorSummary,
    TopChannel,
    UnitSummary,
)
from .options import AT_LEAST_1, check_range
from .quant import fused, quantization_of
from .stats import fmt

__all__ = ["observe", "ObserveReport", "TensorStats", "UnitStats", "MassiveActivations"]

log = logging.getLogger("quantgate")

LOG_LO, LOG_HI, LOG_BINS = -10.0, 10.0, 2000  # |x| histogram over 1e-10 .. 1e10, 0.01 decade per bin
HIST_SAMPLE = 1 << 16  # elements per update that feed the |x| histogram (median); the rest is exact
CHUNK = 1 << 22  # elements of a tensor folded in at a time: bounds TensorStats' temporaries (~50 MB)
UNIT_BINS = 20  # histograms of values in [0, 1] (gates, sink mass)


def paper_tensors(family: Family) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Per block: the tensors of Bondarenko et al.'s kurtosis, and those added for the max inf-norm."""
    if family.objective == "mlm":  # BERT, post-LN: the FFN output and LN(FFN output + residual)
        return ("ffn_out", f"norm_out.{family.ffn_norm}"), (f"norm_in.{family.ffn_norm}",)
    return ("block_out", "attn_out", "ffn_out", f"norm_out.{family.attn_norm}", f"norm_out.{family.ffn_norm}"), ()


def _stride(n: int, channels: int) -> int:
    """A prime sampling stride that takes about HIST_SAMPLE of n elements and visits every channel."""
    p = max(1, n // HIST_SAMPLE)
    if p == 1:
        return 1
    while any(p % q == 0 for q in range(2, int(p**0.5) + 1)) or channels % p == 0:
        p += 1
    return p


def _histogram(sample: torch.Tensor) -> torch.Tensor:
    """Counts (LOG_BINS,) float64 of the |x| values in ``sample`` (float32, >= 0, consumed: changed in place)
    on the 0.01-decade log10 scale: torch.histc's bins by its own arithmetic, truncating (log10 |x| - LOG_LO)
    x LOG_BINS / (LOG_HI - LOG_LO), the top edge in the last bin (tests/test_observe_speed.py holds the counts
    to histc's), at about a tenth of histc's cost on a CPU; the steps after the log in one pass where the fused
    kernels serve (:func:`.quant.fused.log_bins`)."""
    logs = sample.clamp_min_(10**LOG_LO).log10_()
    counts = fused.log_bins(logs, LOG_LO, LOG_HI - LOG_LO, LOG_HI - 1e-6, LOG_BINS)
    if counts is not None:
        return counts
    logs = logs.clamp_max_(LOG_HI - 1e-6)
    bins = logs.sub_(LOG_LO).mul_(LOG_BINS).div_(LOG_HI - LOG_LO).int().clamp_max_(LOG_BINS - 1)
    return torch.bincount(bins.reshape(-1), minlength=LOG_BINS).double()


class TensorStats:
    """Running statistics of one activation tensor (B, T, ...) over many batches."""

    def __init__(self) -> None:
        self.sequences = 0
        self.kurtosis_sum = 0.0
        self.kurtosis_n = 0
        self.hist = torch.zeros(LOG_BINS, dtype=torch.float64)
        self.channel_max: torch.Tensor | None = None
        self.channel_top: torch.Tensor | None = None
        self.nonfinite = 0
        # per batch: each sequence's max |x|, its real-token position and token id (counted in summary())
        self.seq_max: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    @torch.no_grad()
    def update(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> float | None:
        """Fold in ``x`` (B, T, ...), C = prod(...) features per token; ``valid`` (B, T) marks real
        (non-padding) tokens, the only ones measured; positions count real tokens. Returns the batch's
        largest |x| (inf where it holds NaN or inf) when it has no padding, else None.

        Two passes over chunks of about CHUNK elements (whole sequences, or one sequence's tokens in
        pieces): maxima, channels, histogram sample and sums, then the centred moments (float64
        accumulation). A tensor of one chunk is read into float32 once and its |x| serves as the histogram
        sample in place; no other full-size copy of ``x`` is made.
        """
        b, t = x.shape[:2]
        keep = None if valid is None or bool(valid.all()) else valid.to(x.device, torch.bool)
        real = torch.full((b,), t) if keep is None else keep.sum(1).cpu()  # (B,) real tokens
        c, n = math.prod(x.shape[2:]), int(real.sum())
        if n == 0:
            return None
        if keep is None and b * t * c <= CHUNK and t > 0:
            largest = self._update_whole(x.reshape(b, t, c), input_ids)
            if largest is not None:
                return largest
        rows, step = (max(1, CHUNK // (t * c)), t) if t * c <= CHUNK else (1, max(1, CHUNK // c))
        spans = [(slice(i, i + rows), slice(j, j + step)) for i in range(0, b, rows) for j in range(0, t, step)]
        stride, offset, samples, finite = _stride(n * c, c), 0, [], True
        whole = len(spans) == 1  # one chunk: its float32 values are kept for the second pass
        total = torch.zeros(b, dtype=torch.float64, device=x.device)
        seq_max, pos = torch.full((b,), -1.0, device=x.device), torch.zeros(b, dtype=torch.long, device=x.device)
        cmax, top = torch.zeros(c, device=x.device), torch.zeros(c, dtype=torch.long, device=x.device)
        values = None
        for r, s in spans:
            xc, k = _tokens(x, keep, r, s)
            a = xc.abs() if k is None else xc.abs().masked_fill_(~k, -1.0)  # padding: never a maximum nor sampled
            tok_max, tok_arg = a.max(dim=2)  # each token's largest |x| and its channel
            if not bool(torch.isfinite(tok_max).all()):  # NaN/inf: count them, keep them out of the statistics
                self.nonfinite += int((~torch.isfinite(xc)).sum())
                finite, xc = False, xc.nan_to_num(0.0, 0.0, 0.0)
                tok_max, tok_arg = a.nan_to_num_(0.0, 0.0, 0.0).max(dim=2)
            m, p = tok_max.max(dim=1)
            better = m > seq_max[r]  # strict: the first position of a tie wins, as in one pass
            seq_max[r], pos[r] = torch.where(better, m, seq_max[r]), torch.where(better, p + s.start, pos[r])
            top += torch.bincount(tok_arg.reshape(-1) if k is None else tok_arg[k[..., 0]], minlength=c)
            cmax = torch.maximum(cmax, a.reshape(-1, c).amax(dim=0))
            total[r] += xc.sum(dim=2).double().sum(dim=1)
            sample = a.reshape(-1)[-offset % stride :: stride]  # every stride-th element of all chunks
            samples.append(sample if whole and stride == 1 else sample.clone())  # a itself: consumed below
            offset += a.numel()
            values = xc if whole else None
        count = (real * c).to(x.device, torch.float64)
        mean = (total / count.clamp_min(1)).float().view(b, 1, 1)
        m2, m4 = torch.zeros_like(total), torch.zeros_like(total)
        for r, s in spans:  # kurtosis mu4 / sigma^4 over each sequence's flattened T x C tensor
            if values is not None:  # the one chunk, read into float32 by the first pass
                xc, k = values, None if keep is None else keep[r, s, None]
            else:
                xc, k = _tokens(x, keep, r, s)
            d = (xc if finite else xc.nan_to_num(0.0, 0.0, 0.0)) - mean[r]
            if k is not None:
                d.masked_fill_(~k, 0.0)
            m2[r] += d.square_().sum(dim=2).double().sum(dim=1)
            m4[r] += d.square_().sum(dim=2).double().sum(dim=1)
        ok = (count > 0) & (m2 > 0)
        self.kurtosis_sum += float((m4[ok] * count[ok] / m2[ok].square()).sum())  # (m4 / n) / (m2 / n)^2
        self.kurtosis_n += int(ok.sum())
        sample = samples[0] if len(samples) == 1 else torch.cat(samples)
        if keep is not None:
            sample = sample[sample >= 0]  # padding is -1
        if sample.numel():
            self.hist += _histogram(sample).cpu() * (n * c / sample.numel())  # the sample stands for all n * c
        self.channel_max = cmax if self.channel_max is None else torch.maximum(self.channel_max, cmax)
        self.channel_top = top if self.channel_top is None else self.channel_top + top
        seqs = (real > 0).nonzero().squeeze(1)
        seq_max, pos = seq_max.cpu()[seqs], pos.cpu()[seqs]
        self.seq_max.append(seq_max)
        self.positions.append(pos if keep is None else keep.cpu()[seqs].cumsum(1).gather(1, pos[:, None])[:, 0] - 1)
        if input_ids is not None and input_ids.shape[1] == t:
            self.tokens.append(input_ids.cpu()[seqs, pos])
        self.sequences += len(seqs)
        return (float(seq_max.max()) if finite else math.inf) if keep is None else None

    def _update_whole(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> float | None:
        """:meth:`update` of an unpadded tensor of one chunk, ``x`` (b, T, C) in its own dtype (a view: never
        written), in as few passes as its statistics need: the fused kernel's two where it serves
        (:func:`.quant.fused.tensor_stats`), else :meth:`_whole_eager`'s; None, with nothing folded in, where x
        holds NaN or inf, which the general path counts and leaves out."""
        b, t, c = x.shape
        moments = fused.tensor_stats(x)
        if moments is None:
            moments = self._whole_eager(x.float())
            if moments is None:
                return None
        seq_max, pos, top, cmax, m2, m4 = moments
        largest = float(seq_max.max())
        count = float(t * c)
        stride = _stride(b * t * c, c)
        sample = x.reshape(-1)[::stride].float().abs()  # every stride-th |x|, a copy (_histogram consumes it)
        self.hist += _histogram(sample).cpu() * (b * t * c / sample.numel())  # the sample stands for all values
        ok = m2 > 0
        self.kurtosis_sum += float(torch.where(ok, m4 * count / m2.square(), 0.0).sum())  # (m4 / n) / (m2 / n)^2
        self.kurtosis_n += int(ok.sum())
        self.channel_max = cmax if self.channel_max is None else torch.maximum(self.channel_max, cmax)
        self.channel_top = top if self.channel_top is None else self.channel_top + top
        self.seq_max.append(seq_max.cpu())
        self.positions.append(pos.cpu())
        if input_ids is not None and input_ids.shape[1] == t:
            self.tokens.append(input_ids.cpu().gather(1, pos.cpu()[:, None])[:, 0])
        self.sequences += b
        return largest

    @staticmethod
    def _whole_eager(x: torch.Tensor) -> list[torch.Tensor] | None:
        """:meth:`_update_whole`'s statistics of float32 ``x`` (b, T, C) by torch ops (the reference of the fused
        kernel): each sequence's largest |x| and its first position, each channel's count of token maxima and its
        largest |x|, each sequence's centred second and fourth moments (float64); None where x holds NaN or inf."""
        b, t, c = x.shape
        a = x.abs()
        tok_max, tok_arg = a.max(dim=2)  # each token's largest |x| and its channel
        seq_max, pos = tok_max.max(dim=1)
        if not math.isfinite(float(seq_max.max())):
            return None
        top = torch.bincount(tok_arg.reshape(-1), minlength=c)
        cmax = a.reshape(-1, c).amax(dim=0)
        mean = (x.sum(dim=2).double().sum(dim=1) / float(t * c)).float().view(b, 1, 1)
        d = torch.sub(x, mean, out=a)  # a's buffer: |x| is read
        m2 = d.square_().sum(dim=2).double().sum(dim=1)
        m4 = d.square_().sum(dim=2).double().sum(dim=1)
        return [seq_max, pos, top, cmax, m2, m4]

    @property
    def max_abs(self) -> float:
        return float(torch.cat(self.seq_max).max()) if self.seq_max else 0.0

    @property
    def median_abs(self) -> float:
        total = float(self.hist.sum())
        if total == 0:
            return 0.0
        idx = int(torch.searchsorted(self.hist.cumsum(0), torch.tensor(total / 2, dtype=torch.float64)))
        return 10 ** (LOG_LO + (idx + 0.5) * (LOG_HI - LOG_LO) / LOG_BINS)

    def summary(self, decode: Decode | None = None, top: int = 5) -> TensorSummary:
        n = max(self.sequences, 1)
        med, max_abs = self.median_abs, self.max_abs
        channels = None
        channel_top, channel_max = self.channel_top, self.channel_max
        if channel_top is not None and channel_max is not None:  # set together by the first update
            tokens = float(channel_top.sum())
            order = torch.argsort(channel_max, descending=True)[:top]  # the largest-magnitude channels
            counts, largest = channel_top[order].tolist(), channel_max[order].tolist()
            channels = [TopChannel(ch, k / tokens, m) for ch, k, m in zip(order.tolist(), counts, largest, strict=True)]
        positions = Counter(torch.cat(self.positions).tolist()) if self.positions else Counter()
        max_tokens = Counter(torch.cat(self.tokens).tolist()) if self.tokens else Counter()
        return TensorSummary(
            inf_norm=sum(float(m.sum()) for m in self.seq_max) / n,
            max_abs=max_abs,
            kurtosis=self.kurtosis_sum / self.kurtosis_n if self.kurtosis_n else None,
            median_abs=med,
            max_median_ratio=max_abs / med if med > 0 else None,
            sequences=self.sequences,
            max_at_token0=positions.get(0, 0) / n,
            max_positions=[[p, c] for p, c in positions.most_common(top)],
            top_channels=channels,
            max_tokens=[[decode(t) if decode else t, c] for t, c in max_tokens.most_common(top)] or None,
            nonfinite=self.nonfinite or None,
        )


def _tokens(
    x: torch.Tensor, keep: torch.Tensor | None, rows: slice, tokens: slice
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x[rows, tokens]`` (x: (B, T, ...)) as float32 (b, L, C) with padding set to 0 (a view of ``x``
    where it is float32 and unpadded: never to be written), and its mask ``keep`` (b, L, 1) or None."""
    xc = x[rows, tokens]
    xc = xc.reshape(*xc.shape[:2], -1).float()
    if keep is None:
        return xc, None
    k = keep[rows, tokens, None]
    return xc.masked_fill(~k, 0.0), k


class UnitStats:
    """Per-head running mean, share below 0.1 and a histogram of values in [0, 1] (gates, sink mass)."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.below = 0.0
        self.hist = torch.zeros(UNIT_BINS, dtype=torch.float64)

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        """``values`` (heads, n): one row per head."""
        v = values.detach().float()
        s, n = v.sum(dim=1).double(), torch.full((v.shape[0],), v.shape[1], dtype=torch.float64)
        if self.sum is None or self.count is None:  # the first update (they are set together)
            self.sum, self.count = s, n
        else:
            self.sum, self.count = self.sum + s, self.count + n
        self.below += float((v < 0.1).sum())
        self.hist += torch.histc(v.clamp(0, 1), bins=UNIT_BINS, min=0.0, max=1.0).double()

    def summary(self) -> UnitSummary | None:
        if self.sum is None or self.count is None:
            return None
        total = float(self.count.sum())
        return UnitSummary(
            mean=float(self.sum.sum()) / total,
            below_0_1=self.below / total,
            per_head=(self.sum / self.count).tolist(),
            hist=(self.hist / self.hist.sum()).tolist(),
        )


def _gate_rows(values: torch.Tensor, position: str, heads: int) -> torch.Tensor:
    """Gate multiplier -> (gate heads, n) for per-head statistics."""
    if position == "value":  # (B, N, Hkv * D)
        b, n, _width = values.shape
        return values.reshape(b, n, heads, -1).transpose(0, 2).reshape(heads, -1)
    if position == "output":  # (B, N, d_model): no head structure
        return values.reshape(1, -1)
    return values.transpose(0, 1).reshape(values.shape[1], -1)  # (B|1, H|1, N|1, D|1)


@dataclass
class _Layer:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    massive: MassiveActivations = field(default_factory=MassiveActivations)
    sink: UnitStats = field(default_factory=UnitStats)
    gate: UnitStats = field(default_factory=UnitStats)

    def stats(self, name: str) -> TensorStats:
        return self.tensors.setdefault(name, TensorStats())


class _Observer:
    """Registers the hooks for one observe run; removes them on exit."""

    def __init__(self, model: nn.Module, sink_tokens: int) -> None:
        self.model, self.sink_tokens = model, sink_tokens
        self.family = family_of(model)
        self.blocks = self.family.blocks(model)
        self.layers = [_Layer() for _ in self.blocks]
        self.final, self.final_out = TensorStats(), TensorStats()  # the final norm's input and output
        self.input_ids: torch.Tensor | None = None  # the batch's (B, T) ids and real-token mask, set per batch
        self.valid: torch.Tensor | None = None
        # id -> (weak reference, version, stats) of the tensors measured so far
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], int, TensorStats]] = {}
        self.handles: list[RemovableHandle] = []
        self.attn_layer: dict[int, int] = {}

    def __enter__(self) -> _Observer:
        fam = self.family
        with_attention = {id(b) for b in fam.attention_blocks(self.model)}
        for i, block in enumerate(self.blocks):
            layer = self.layers[i]
            self._hook(block, lambda m, a, o, L=layer: self._record(L, "block_out", o, massive=True))
            skip: set[nn.Module] = set()
            if id(block) in with_attention:
                attn = cast(VariantAttention, block.get_submodule(fam.attention))
                attn.qg_observer = self
                self.attn_layer[id(attn)] = i
                o_proj = block.get_submodule(fam.o_proj)
                skip.add(o_proj)
                self._hook(o_proj, lambda m, a, o, L=layer: self._record(L, "attn_pre_o", a[0], then=("attn_out", o)))
                gate = getattr(attn, "gate", None)
                if gate is not None:
                    skip.update(gate.modules())
                    self._hook(
                        gate, lambda m, a, o, L=layer: L.gate.update(_gate_rows(o, m.position, m.dims.n_kv_heads))
                    )
                elif fam.native_gate_values is not None:  # a built-in gate (Qwen3-Next): the family reads it
                    dims, values = fam.dims(config_of(self.model)), fam.native_gate_values
                    self._hook(
                        block.get_submodule(fam.q_proj),
                        lambda m, a, o, L=layer, d=dims, f=values: L.gate.update(f(o, d)),
                    )
            ffn = block.get_submodule(fam.ffn)
            self._hook(ffn, lambda m, a, o, L=layer: self._record(L, "ffn_out", o))
            for name, module in block.named_modules():
                if module in skip or not name:
                    continue
                if isinstance(module, nn.Linear):
                    self._hook(module, lambda m, a, o, L=layer, n=name: self._record(L, f"linear_in.{n}", a[0]))
                elif is_norm(module):
                    self._hook(
                        module,
                        lambda m, a, o, L=layer, n=name: self._record(
                            L, f"norm_in.{n}", a[0], then=(f"norm_out.{n}", o)
                        ),
                    )
        final = fam.final_norm_of(self.model)
        if final is not None:
            self._hook(final, self._record_final)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        for attn in attention_modules(self.model):
            cast(VariantAttention, attn).qg_observer = None

    def _hook(self, module: nn.Module, fn: Callable[..., None]) -> None:
        self.handles.append(module.register_forward_hook(fn))

    def _record_final(self, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        self.final.update(args[0], self.input_ids, self.valid)
        self.final_out.update(out, self.input_ids, self.valid)

    def _record(
        self, layer: _Layer, name: str, out: Any, massive: bool = False, then: tuple[str, Any] | None = None
    ) -> None:
        """Fold a hooked tensor into the layer's statistics and let it go (returns None: hooks must not
        replace outputs). The same tensor object feeding several modules (q/k/v, gate/up) is measured
        once; ``seen`` holds only a weak reference to it, so no activation outlives its use."""
        x: torch.Tensor = out[0] if isinstance(out, tuple) else out
        seen = self.seen.get(id(x))
        largest = None  # the batch's largest |x|, where the statistics measured all of x
        if seen is not None and seen[0]() is x and seen[1] == x._version:
            layer.tensors.setdefault(name, seen[2])
        else:
            stats = layer.stats(name)
            self.seen[id(x)] = (weakref.ref(x), x._version, stats)
            assert self.input_ids is not None, "observe sets the batch's input_ids before its forward pass"
            tokens = _by_token(x, *self.input_ids.shape)
            if tokens is None:
                largest = stats.update(x.reshape(1, -1, x.shape[-1]))
            else:
                largest = stats.update(tokens, self.input_ids, self.valid)
        if massive and (largest is None or largest > layer.massive.absolute):  # below it nothing is massive
            layer.massive.update(x, self.input_ids)
        if then is not None:
            self._record(layer, *then)

    def record_sink_mass(self, module: nn.Module, mass: torch.Tensor) -> None:
        """mass (B, H, N): attention on the first sink_tokens keys, from gated_sdpa."""
        layer = self.layers[self.attn_layer[id(module)]]
        b, _h, n = mass.shape
        keep = torch.ones(b, n, dtype=torch.bool)
        if getattr(module, "is_causal", True):
            keep[:, : self.sink_tokens] = False  # these queries can see nothing but the sink tokens
        if self.valid is not None and self.valid.shape == keep.shape:
            keep &= self.valid
        rows = mass.float().transpose(0, 1)[:, keep]  # (H, kept queries)
        if rows.numel():
            layer.sink.update(rows)


def _by_token(x: torch.Tensor, b: int, t: int) -> torch.Tensor | None:
    """``x`` as a view with batch and tokens first, (B, T, ...), or None when no axis holds the tokens.

    (B, T, ...) stays as is; (B, ..., T, ..., d) has its first axis of size T before the features
    moved to 1 (MLA's latent (B, 1, T, r) into kv_b_proj); (B * T, ...) is unflattened (OPT flattens
    the tokens before its FFN).
    """
    if x.dim() >= 3 and x.shape[0] == b:
        for axis in range(1, x.dim() - 1):
            if x.shape[axis] == t:
                return x if axis == 1 else x.movedim(axis, 1)
    if x.shape[0] == b * t:
        return x.unflatten(0, (b, t))
    return None


@dataclass
class ObserveReport(JsonRecord):
    """What observe measured: ``summary`` (headline numbers), ``layers`` (per block), ``meta``."""

    summary: ObserveSummary
    layers: list[LayerSummary]
    meta: ObserveMeta

    def save(self, out: str | Path) -> Path:
        """Write observe.json, observe.md and PNG plots into directory ``out``."""
        from .plots import plot_observe  # matplotlib: imported at first use (~0.7 s; `import quantgate` skips it)

        out = Path(out)
        write_text_atomic(out / "observe.json", json.dumps(self.to_json(), indent=1))
        (out / "observe.md").write_text(self.markdown())
        plot_observe(self.layers, self.meta, out)
        return out

    @classmethod
    def load(cls, path: str | Path) -> ObserveReport:
        path = Path(path)
        data = json.loads((path / "observe.json" if path.is_dir() else path).read_text())
        return cls.from_json(data)

    def markdown(self) -> str:
        s, m = self.summary, self.meta
        lines = [
            f"# Observe: {m.model} ({m.variant}" + (f", quantized {m.quantization})" if m.quantization else ")"),
            "",
            f"{m.sequences} sequences x {m.seq_len} tokens from `{m.data}`; sink = first {m.sink_tokens} key(s).",
            "",
            "| metric | value |",
            "|---|---|",
        ]
        headline = {
            "max_inf_norm": s.max_inf_norm,
            "kurtosis": s.kurtosis,
            "max_activation": s.max_activation,
            "max_median_ratio": s.max_median_ratio,
            "sink_mass": s.sink_mass,
            "gate_mean": s.gate_mean,
            "gate_below_0.1": s.gate_below_0_1,
            "massive_activations": s.massive_activations,
            "loss": s.loss,
        }
        lines += [f"| {key} | {fmt(value)} |" for key, value in headline.items()]
        lines += [
            "",
            "| layer | residual max abs | max / median | kurtosis (mean) | sink mass | gate mean | massive |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, L in enumerate(self.layers):
            res = L.residual
            lines.append(
                f"| {i} | {fmt(res.max_abs)} | {fmt(res.max_median_ratio)} | {fmt(L.kurtosis)} | "
                f"{fmt(L.sink_mass)} | {fmt(L.gate_mean)} | {L.massive_activations} |"
            )
        massive = [(i, e) for i, L in enumerate(self.layers) for e in L.massive]
        if massive:
            lines += [
                "",
                "Largest massive activations (residual stream):",
                "",
                "| layer | channel | max abs | count | positions | tokens |",
                "|---|---|---|---|---|---|",
            ]
            for i, e in sorted(massive, key=lambda t: -t[1].max_abs)[:10]:
                lines.append(f"| {i} | {e.channel} | {fmt(e.max_abs)} | {e.count} | {e.positions} | {e.tokens} |")
        if s.nonfinite:
            lines += [
                "",
                "**Non-finite activations** (layer, tensor, count): "
                + ", ".join(f"({n.layer}, {n.tensor}, {n.count})" for n in s.nonfinite),
            ]
        return "\n".join(lines) + "\n"


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


@torch.no_grad()
def observe(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    sink_tokens: int = 1,
    max_batches: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = True,
) -> ObserveReport:
    """Stream statistics of ``model`` over ``batches`` (dicts with input_ids, optional attention_mask
    and labels, (B, T)) and return an :class:`ObserveReport`. The model is put in eval mode. Batches
    without labels run the base model only (no LM head, no logits); with labels, the model and its loss."""
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 1:
        raise InputError(
            f"sink_tokens is how many leading keys count as the sink: a whole number >= 1, got {sink_tokens!r}"
        )
    family = family_of(model)
    if variant_of(model) is None:
        apply_variant(model)  # route attention through quantgate (the model's own attention, unchanged)
    tokenizer = tokenizer if tokenizer is not None else getattr(batches, "tokenizer", None)
    decode = (lambda t: tokenizer.convert_ids_to_tokens(int(t))) if tokenizer is not None else None
    device = next(model.parameters()).device
    losses, tokens, sequences, seq_len, n_batches = [], 0, 0, 0, 0
    total = len(batches) if isinstance(batches, Sized) else None
    check_range("max_batches", max_batches, AT_LEAST_1)  # None: every batch
    if max_batches is not None:
        total = max_batches if total is None else min(total, max_batches)
    with eval_mode(model), _Observer(model, sink_tokens) as obs:
        for batch in tqdm(itertools.islice(batches, max_batches), total=total, desc="observe", disable=not progress):
            ids = batch["input_ids"]
            family.check_seq_len(config_of(model), ids.shape[1])
            if sink_tokens >= ids.shape[1]:
                raise InputError(
                    f"sink_tokens={sink_tokens} leaves no other key in {ids.shape[1]}-token "
                    f"sequences; use fewer sink tokens or longer sequences"
                )
            mask = batch.get("attention_mask")
            obs.input_ids, obs.seen = ids, {}
            obs.valid = mask.bool() if mask is not None else None
            forward = model if "labels" in batch else cast(nn.Module, model.base_model)
            out = forward(**{k: v.to(device) for k, v in batch.items()})
            if getattr(out, "loss", None) is not None:
                losses.append(float(out.loss))
            n_batches += 1
            tokens += int(mask.sum()) if mask is not None else ids.numel()
            sequences += ids.shape[0]
            seq_len = max(seq_len, ids.shape[1])
    if sequences == 0:
        raise InputError("observe got no batches: the data source is empty or max_batches is 0")
    layers, summary = _summary(obs, family, decode, losses, tokens)
    meta = ObserveMeta(
        variant=str(variant_of(model)),
        family=family.name,
        sink_tokens=sink_tokens,
        sequences=sequences,
        seq_len=seq_len,
        batches=n_batches,
        data=getattr(batches, "split", None),
        model=getattr(model.config, "_name_or_path", "") or None,
        quantization=q.scheme if (q := quantization_of(model)) else None,  # quantgate's scheme or another tool's
    )
    return ObserveReport(summary, layers, meta)


def _summary(
    obs: _Observer, family: Family, decode: Decode | None, losses: list[float], tokens: int
) -> tuple[list[LayerSummary], ObserveSummary]:
    """The per-layer summaries of an observe run and the model's headline numbers over them."""
    kurt_set, inf_extra = paper_tensors(family)
    layers = [_layer_summary(L, decode, kurt_set, inf_extra) for L in obs.layers]
    nonfinite = [
        NonFinite(i, name, t.nonfinite) for i, L in enumerate(layers) for name, t in L.tensors.items() if t.nonfinite
    ]
    if nonfinite:
        log.warning("observe: non-finite activations (excluded from the statistics): %s", nonfinite[:5])
    res = [L.residual for L in layers]
    gate_means = [L.gate_mean for L in layers if L.gate_mean is not None]
    final_out = obs.final_out.summary(decode) if obs.final_out.sequences and family.objective == "clm" else None
    outer = [final_out] if final_out else []
    paper = [L.tensors[n] for L in layers for n in kurt_set if n in L.tensors] + outer
    summary = ObserveSummary(
        max_inf_norm=max([L.max_inf_norm for L in layers] + [t.inf_norm for t in outer]),
        kurtosis=_mean(t.kurtosis for t in paper),  # over tensors, as the reference code averages
        max_activation=max(r.max_abs for r in res),
        max_median_ratio=max((r.max_median_ratio or 0.0) for r in res),
        sink_mass=_mean(L.sink_mass for L in layers),
        gate_mean=_mean(gate_means) if gate_means else None,
        gate_below_0_1=_mean(L.gate.below_0_1 for L in layers if L.gate) if gate_means else None,
        massive_activations=sum(L.massive_activations for L in layers),
        loss=_mean(losses) if losses else None,
        tokens=tokens,
        max_at_token0=max(res, key=lambda r: r.max_abs).max_at_token0,
        nonfinite=nonfinite,
        final_norm_in=obs.final.summary(decode) if obs.final.sequences else None,
        final_norm_out=final_out,
    )
    return layers, summary


def _layer_summary(
    layer: _Layer, decode: Decode | None, kurt_set: tuple[str, ...], inf_extra: tuple[str, ...]
) -> LayerSummary:
    # a tensor feeding several modules has one TensorStats under their names: summarised once
    once = {id(t): t.summary(decode) for t in {id(t): t for t in layer.tensors.values()}.values()}
    tensors = {name: once[id(t)] for name, t in layer.tensors.items()}
    paper = [tensors[n] for n in kurt_set if n in tensors]
    sink, gate = layer.sink.summary(), layer.gate.summary()
    return LayerSummary(
        max_inf_norm=max(t.inf_norm for t in paper + [tensors[n] for n in inf_extra if n in tensors]),
        kurtosis=_mean(t.kurtosis for t in paper),
        max_activation=tensors["block_out"].max_abs,
        sink_mass=sink.mean if sink else None,
        gate_mean=gate.mean if gate else None,
        massive_activations=layer.massive.count,
        tensors=tensors,
        sink=sink,
        gate=gate,
        massive=layer.massive.summary(decode),
    )
