"""Simulated (fake) quantization wired into a model: weights are replaced by their quantized values,
activations pass through :class:`ActQuant` modules placed where the scheme's ``acts`` says.

What the reference quantizes. Bondarenko et al. 2023's code (github Qualcomm-AI-research/
outlier-free-transformers, commit 1e59744, read for this list) wraps each op in a quantizer of its
*output*: ``quantization/autoquant_utils.py`` (QuantLinear, QuantLayerNorm, QuantEmbedding),
``quantization/hijacker.py`` (weights quantized in forward, output after an activation fused into
the Linear: fc1+ReLU, dense+GELU), ``transformers_language/models/quantized_opt.py`` and
``quantized_bert.py`` (the sites below), ``transformers_language/quant_configs.py``, ``utils.py``
(val_qparams, 16-batch range estimation), ``validate_clm.py`` / ``validate_mlm.py`` and the README's
INT8 commands. Per block, in order:

* q, k, v: the outputs of the q/k/v Linears (OPT multiplies q by d^-1/2 after its quantizer; before
  it here, the same grid when d^-1/2 is a power of two: d = 16, 64, 256);
* the softmax input (scores, after the 1/sqrt(d) scaling, before the mask) and its output (after
  clipping, for clipped softmax);
* the attention output P @ V ("context"): BERT quantizes it after the gate, OPT before it (the gate's
  product then enters out_proj unquantized);
* out_proj / dense output; the residual sum after attention;
* the LayerNorm outputs (pre-LN OPT: before attention and FFN, their inputs being the residual sums;
  post-LN BERT: the LN input *is* the residual sum, also quantized);
* fc1 + ReLU (OPT) / dense + GELU (BERT) output, fc2 / dense output, the residual sum after the FFN.
Outside the blocks: embedding lookups are not re-quantized (their tables are quantized weights), the
sums of embeddings are (OPT: token + position; BERT: word + type, then + position, then the LN output),
the final LayerNorm output is (OPT). Full precision: the LM head (OPT ``--quant_setup fp32_head``;
BERT keeps its whole MLM head ``cls``: transform dense, GELU, LN, decoder), the attention gate
(``self.alpha``: "do not quantize for now"; its input is the quantized LN output), Linear biases.
Weights: all Linear, Embedding and LayerNorm weights, per tensor, symmetric (-2^(b-1)..2^(b-1)-1),
min-max (BERT) or MSE grid search (OPT's validate_clm.py). Activations: per tensor, asymmetric
(0..2^b - 1), running min-max with momentum 0.9; 16 calibration batches (quant_configs.py, BERT's
README command; OPT's README command uses 4 batches of one 512-token sequence and per-batch 99.999
percentiles in the running min-max). OPT's text is packed into blocks with no BOS at position 0.

Placements (``acts``):

* ``linear-inputs``: the input of every nn.Linear but the kept ones (the LM head, the attention gates
  unless ``gates=true``, ``keep`` patterns), and nothing else: the residual stream, norm outputs,
  q/k/v and softmax stay in float.
* ``bondarenko`` (``everything`` is an alias): the reference's sites, for every family, from the
  Family data (models/families.py). A projection and the elementwise ops that follow it up to the
  next matmul (ReLU/GELU, SwiGLU's act(gate) * up, RoPE, QK-norm, the attention gate) count as one
  op, quantized where it enters that matmul, as fc1 + ReLU is in the reference; so the attention
  output is quantized after the gate (BERT's choice). Sites in a block (names as the quantizers
  print them, ``<module> input|output`` or ``<attention> q|k|v|scores|probs``):

  ======================  ============================  =================================  ==================
  reference site          opt (pre-LN)                  llama, qwen2/3, qwen3-next, mla    bert (post-LN)
  ======================  ============================  =================================  ==================
  LN before attention     self_attn_layer_norm output   input_layernorm output             --
  q, k, v, scores, probs  self_attn q k v scores probs  self_attn q k v scores probs       attention.self ...
  context (P @ V)         self_attn.out_proj input      self_attn.o_proj input             a.output.dense in
  out_proj output         self_attn.out_proj output     self_attn.o_proj output            a.output.dense out
  residual sum 1          final_layer_norm input        post_attention_layernorm input     a.output.LN input
  LN output               final_layer_norm output       post_attention_layernorm output    a.output.LN output
  fc1 + act output        fc2 input                     mlp.down_proj input                output.dense input
  fc2 output              fc2 output                    mlp output                         output.dense out
  residual sum 2          <block> output                <block> output                     output.LN input
  LN output               --                            --                                 output.LN output
  ======================  ============================  =================================  ==================

  Post-LN OPT (``do_layer_norm_before=false``, OPT-350m) has bert's norm sites.
  Model level: the embedding sum (opt: ``decoder.layers.0 input``; bert: ``embeddings.LayerNorm
  input``; llama-style models have a single lookup, on the quantized table), the final norm output
  (``norm`` / ``decoder.final_layer_norm``; bert: ``embeddings.LayerNorm output``). MLA adds
  ``self_attn.q_b_proj input`` and ``self_attn.kv_b_proj input`` (the latents after their norms);
  qwen3-next's linear-attention blocks add ``linear_attn.out_proj`` input and output and its MoE
  blocks ``mlp.shared_expert.down_proj input``. Weights: every quantized Linear, and per tensor the
  embedding tables (untied from a full-precision head) and norm weights. Full precision: the head
  (bert: all of ``cls``), the attention gates unless ``gates=true`` (then their Linears' weights,
  inputs and outputs, the sigmoid input, are quantized too; qwen3-next's built-in gate is part of
  q_proj and always quantized with it), biases, and what is no nn.Linear: fused MoE expert tensors,
  routers, linear-attention convolutions and state, per-head gate matrices. Differences from the
  reference: BERT's word + type partial sum has no hook point in transformers (only the full sum is
  quantized), the context is quantized after the gate in OPT as in BERT, and RoPE models quantize
  q and k after RoPE, where they enter the matmul. ``w8a8-int8-bondarenko`` takes min-max weight
  ranges and running min-max activation ranges (BERT's protocol); OPT's are ``w_estimator=mse`` (a grid of
  clipping ratios, :func:`~.quantizers.quantize_weight`; the reference's grid is 100 thresholds
  i (max|w| + 0.5) / 100, not reproduced) and ``estimator=running-percentile`` (``percentile=99.999``:
  the running average of each batch's exact percentiles, :class:`~.quantizers.RangeObserver`).
  quantgate's batches start every row with BOS, which the reference's blocks lack and which, at per-tensor
  ranges, can set a range alone: ``calib_skip=K`` leaves the first K positions of each sequence out of
  every static activation range (:class:`ActQuant`; the evaluation still reads them).

A scheme's ``kv`` quantizes the KV cache (:class:`KVQuant`) at every attention's k and v, after RoPE,
where gated_sdpa reads them, behind any q/k/v quantizer of the placement.

The residual sum after attention of a pre-norm block is quantized in place at the FFN norm's input:
the block keeps that tensor as its residual, so the FFN's sum adds the quantized value, as the
reference does. Softmax quantization runs on gated_sdpa's eager backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple, cast

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from ..errors import InputError
from ..models.families import config_of, family_of, find_submodule, is_norm
from ..models.record import record_of, set_record
from ..models.swap import attention_modules
from . import fused
from .compressed_tensors import COMPRESSED_TENSORS, not_held
from .formats import QUANTGATE, Manifest
from .heap import trim
from .mitigate import Calibrate, mitigate, needed
from .quantizers import (
    EPS,
    INT_BITS,
    WEIGHT_QPARAMS,
    RangeObserver,
    fake_quant,
    int_grid,
    qparams,
    quantize_weight,
    quantize_weight_qparams,
)
from .rotate import rotate_
from .schemes import Scheme, SimulatedScheme, TensorQuant, handles
from .sites import kept_modules, quantizable_linears

__all__ = [
    "ActQuant",
    "KVQuant",
    "apply_simulated",
    "act_quantizers",
    "check_ranges",
    "check_keep",
    "kept_modules",
    "quantizable_linears",
    "WEIGHT_QPARAMS",
]


class _Quantized(NamedTuple):
    """What an :class:`ActQuant` made of a tensor: kept for the next quantizer given the same tensor."""

    source: weakref.ref[torch.Tensor]
    version: int  # the source's, when it was read
    spec: TensorQuant
    lo: torch.Tensor  # the static range it used (a dynamic spec's are unused)
    hi: torch.Tensor
    values: torch.Tensor
    values_version: int
    overflow: int


class _Last(threading.local):
    """The tensor an ActQuant quantized last in this thread, and its result. q, k and v (gate and up) read one
    tensor; where their quantizers share a spec and a range, the second and third take the first one's values
    (bit-identical, a third of the per-token work of a block) instead of computing them again. Dropped as soon
    as the tensor is freed, so it keeps no activation alive."""

    entry: _Quantized | None = None

    def take(self, quant: ActQuant, x: torch.Tensor) -> _Quantized | None:
        e = self.entry
        if (
            e is None
            or fused.forced_eager()
            or e.source() is not x
            or e.version != x._version
            or e.values._version != e.values_version
        ):
            return None
        if e.spec != quant.spec or not (
            quant.spec.dynamic or (torch.equal(e.lo, quant.lo) and torch.equal(e.hi, quant.hi))
        ):
            return None
        return e

    def keep(self, quant: ActQuant, x: torch.Tensor, y: torch.Tensor, overflow: int) -> None:
        if fused.forced_eager():
            return
        source = weakref.ref(x, self._drop)
        self.entry = _Quantized(source, x._version, quant.spec, quant.lo, quant.hi, y, y._version, overflow)

    def _drop(self, ref: weakref.ref[torch.Tensor]) -> None:
        if self.entry is not None and self.entry.source is ref:
            self.entry = None


_last = _Last()


class ActQuant(nn.Module):
    """Fake-quantizes the tensors that flow through it.

    While ``calibrating`` it only observes (ranges for static quantization); afterwards it quantizes
    with the frozen range (float32 buffers ``lo``/``hi``, a scalar or one value per channel), or with ranges
    taken from each tensor when the spec is dynamic (per tensor or per token). It counts FP8
    saturation (``overflow`` of ``values``) and, when ``track`` is on, the signal and noise energy
    behind its SQNR. ``name`` says which tensor it quantizes (``model.layers.0.mlp.up_proj input``);
    ``enabled`` off passes tensors through unchanged (one site at a time: :func:`~.error.site_sensitivity`).

    A static spec's ``calib_skip = K`` leaves the first K positions of each sequence out of calibration:
    the observer sees ``x.narrow(axis, K, N - K)`` along the tensor's sequence axis. ``seq_dim`` names that
    axis (2 for attention's (B, H, N, .) q/k/v, scores and probs: the query rows are dropped, every key
    column kept); None finds it from ``tokens``, the (B, N) of the batch being calibrated on (set by
    :func:`apply_simulated`): the first axis after the batch's of length N in a tensor (B, ..., N, ...) of 3
    or more dims, or the rows of a (B * N, ...) one that flattens the tokens (OPT's FFN). Where neither
    fits, the tensor is refused (ValueError naming the site); a sequence of K positions or fewer gives
    nothing to observe.
    """

    lo: torch.Tensor  # buffers, registered in __init__
    hi: torch.Tensor
    amax: torch.Tensor

    def __init__(self, spec: TensorQuant, name: str, seq_dim: int | None = None):
        super().__init__()
        self.spec, self.name, self.seq_dim = spec, name, seq_dim
        self.tokens: tuple[int, int] | None = None  # (B, N) of the calibration batch running (calib_skip)
        self.register_buffer("lo", torch.zeros(()))
        self.register_buffer("hi", torch.zeros(()))
        # NVFP4: the largest |x| seen, for the static per-tensor scale of a compressed-tensors export
        self.register_buffer("amax", torch.zeros(()), persistent=False)
        self.calibrating = not spec.dynamic
        self.observer = (
            RangeObserver(
                spec.estimator, spec.momentum, spec.percentile, name=name, per_channel=spec.granularity == "channel"
            )
            if self.calibrating
            else None
        )
        self.overflow = self.values = 0
        self.track = False
        self.signal = self.noise = 0.0
        self.ndim: int | None = None  # rank of the tensors seen (torchao static scales need it)
        self.enabled = True
        self._grid_key: tuple[int, ...] | None = None  # the static range's grid, computed once: _grid()
        self._grid_value: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ndim = x.dim()
        if not self.enabled:
            return x
        if self.calibrating:
            assert self.observer is not None  # a calibrating quantizer has its observer
            calibrated = self._calibrated_positions(x)
            if calibrated is not None:
                self.observer.update(calibrated)
            return x
        if self.spec.format == "nvfp4":
            self.amax = torch.maximum(self.amax, x.detach().abs().amax().float())
        done = _last.take(self, x)
        if done is not None:
            y, over = done.values, done.overflow
        else:
            y, over = self._quantize(x)
            _last.keep(self, x, y, over)
        self.overflow += over
        self.values += x.numel()
        if self.track:
            xd = x.detach().double()
            self.signal += float(xd.square().sum())
            self.noise += float((xd - y.detach().double()).square().sum())
        return y

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``x`` fake-quantized, and how many of its values saturated."""
        grid = None
        if self.spec.dynamic and self.spec.granularity == "token":
            if self.spec.format in INT_BITS:  # range, grid and round trip in one call where the kernels serve
                qmin, qmax = int_grid(INT_BITS[self.spec.format], self.spec.symmetric)
                y = fused.fake_int_rows(x, qmin, qmax, self.spec.symmetric, EPS)
                if y is not None:
                    return y, 0
            xd = x.detach()  # amin and amax: aminmax(dim=) took 3-9x their time on this CPU
            rows = fused.minmax_rows(xd)
            lo, hi = rows if rows is not None else (xd.amin(dim=-1, keepdim=True), xd.amax(dim=-1, keepdim=True))
        elif self.spec.dynamic:
            lo, hi = (t.reshape((1,) * x.dim()) for t in torch.aminmax(x.detach()))
        else:
            lo, hi, grid = self.lo, self.hi, self._grid()
        return fake_quant(x, lo, hi, self.spec.format, self.spec.symmetric, grid)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen range's scale and zero point (:func:`~.quantizers.qparams`), computed once per range: kept
        with the identity and version of ``lo`` and ``hi``, so a range set or loaded later is picked up."""
        key = (self.lo.data_ptr(), self.lo._version, self.hi.data_ptr(), self.hi._version)
        if self._grid_key != key:
            self._grid_key, self._grid_value = key, qparams(self.lo, self.hi, self.spec.format, self.spec.symmetric)
        assert self._grid_value is not None  # set with the key
        return self._grid_value

    def _calibrated_positions(self, x: torch.Tensor) -> torch.Tensor | None:
        """What calibration observes of ``x``: all of it, or, with ``calib_skip = K``, its positions from K on
        along the sequence axis (None where none is left)."""
        k = self.spec.calib_skip
        if not k:
            return x
        axis = self.seq_dim
        if axis is None and self.tokens is not None:
            b, n = self.tokens
            if x.dim() >= 3 and x.shape[0] == b:
                axis = next((d for d in range(1, x.dim()) if x.shape[d] == n), None)
            if axis is None and x.shape[0] == b * n:  # the tokens flattened into rows
                x, axis = x.unflatten(0, (b, n)), 1
        if axis is None or axis >= x.dim():
            known = f"the batch is {self.tokens[0]} x {self.tokens[1]} tokens" if self.tokens else "no batch ran"
            raise InputError(
                f"{self.name}: calib_skip={k} leaves the first positions of each sequence out of calibration, and "
                f"this site's {tuple(x.shape)} tensor has no sequence axis that quantgate can find ({known}); keep "
                f"the module in full precision (keep=...) or leave calib_skip out"
            )
        n = x.shape[axis]
        return x.narrow(axis, k, n - k) if n > k else None

    def freeze(self) -> None:
        """End calibration: fix the static range from what was observed."""
        if self.calibrating:
            assert self.observer is not None  # a calibrating quantizer has its observer
            if self.observer.batches == 0 and self.spec.calib_skip:
                raise InputError(
                    f"{self.name}: calib_skip={self.spec.calib_skip} left nothing to calibrate on: every calibration "
                    f"sequence it saw has {self.spec.calib_skip} positions or fewer; calibrate on longer sequences "
                    f"or lower calib_skip"
                )
            lo, hi = self.observer.range(self.spec.format, self.spec.symmetric)
            self.lo, self.hi = lo.to(self.lo.device).float(), hi.to(self.hi.device).float()
            self.calibrating, self.observer = False, None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("lo", "hi"):  # per-channel ranges: take the saved shape
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        self.calibrating, self.observer = False, None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        s = self.spec
        kind = f"dynamic per {s.granularity}" if s.dynamic else f"static per {s.granularity}, {s.estimator}"
        if not s.dynamic and s.calib_skip:
            kind += f", calibrated from position {s.calib_skip}"
        return f"{s.format}, {'symmetric' if s.symmetric else 'asymmetric'}, {kind}"


class KVQuant(nn.Module):
    """Quantizes keys or values (B, H_kv, N, D) as a KV cache stores them: each token once, as it is
    written, with ranges from what is written (post-RoPE keys, per head). ``token``: one range per token
    and head; ``group``: per ``group_size`` channels of a token; ``channel`` (keys only, values stay per
    token): one range per channel over each block of ``group_size`` tokens, the last, incomplete block
    kept in full precision (KIVI's residual). The first ``sink`` tokens are kept in full precision.
    The rounding is an :class:`ActQuant`'s (dynamic, one range per row of the view it is given).

    In a whole-sequence forward a block's per-channel range also covers the block's later tokens, which
    a decoding cache would hold in full precision until the block fills: per-channel keys are measured
    slightly pessimistically here."""

    def __init__(self, spec: TensorQuant, name: str, role: str, sink: int = 0):
        super().__init__()
        self.spec, self.role, self.sink = spec, role, sink
        self.quant = ActQuant(dataclasses.replace(spec, granularity="token", dynamic=True), name)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        head, body = t[:, :, : self.sink], t[:, :, self.sink :]
        if body.shape[2] == 0:
            return t
        g = self.spec.group_size
        if self.spec.granularity == "channel" and self.role == "k":
            n = body.shape[2] // g * g
            if n == 0:  # fewer tokens than one block: all of them are the residual, in full precision
                return t
            blocks = body[:, :, :n].unflatten(2, (-1, g)).transpose(-1, -2)  # (B, H, blocks, D, g)
            q = torch.cat([self.quant(blocks).transpose(-1, -2).flatten(2, 3), body[:, :, n:]], dim=2)
        elif self.spec.granularity == "group":
            g = min(g, body.shape[-1])
            if body.shape[-1] % g:
                raise InputError(
                    f"{self.quant.name}: kv_group={g} does not divide the head dim {body.shape[-1]}; pick a divisor"
                )
            q = self.quant(body.unflatten(-1, (-1, g))).flatten(-2)
        else:
            q = self.quant(body)
        return torch.cat([head, q], dim=2) if self.sink else q

    def extra_repr(self) -> str:
        return f"{self.role}, per {self.spec.granularity}, sink={self.sink}"


def check_keep(model: nn.Module, scheme: Scheme) -> None:
    """Raise ValueError for a ``keep`` pattern that matches no module of ``model`` (a typo would keep
    nothing, silently), naming the closest module names."""
    names = [n for n, _ in model.named_modules() if n]
    for pattern in scheme.keep:
        if pattern != "auto" and not any(fnmatch.fnmatch(n, pattern) for n in names):
            near = difflib.get_close_matches(pattern.rstrip("*?."), names, n=3) or names[:3]
            raise InputError(
                f"{scheme.name}: keep pattern {pattern!r} matches no module of this model (names such as "
                f"{', '.join(near)}); fix the pattern (fnmatch, e.g. {near[0]}*)"
            )


def _quant_input(module, args):
    return (module.input_quant(args[0]), *args[1:])


def _quant_input_inplace(module, args):
    """A pre-norm block's first residual sum: its norm's input is also the block's residual."""
    q = module.input_quant(args[0])
    if q is not args[0]:  # calibrating quantizers pass the tensor through
        args[0].copy_(q)


def _quant_output(module, args, output):
    if isinstance(output, tuple):
        return (module.output_quant(output[0]), *output[1:])
    return module.output_quant(output)


def _on_input(module: nn.Module, spec: TensorQuant, name: str, inplace: bool = False) -> None:
    module.input_quant = ActQuant(spec, f"{name} input")
    module.register_forward_pre_hook(_quant_input_inplace if inplace else _quant_input)


def _on_output(module: nn.Module, spec: TensorQuant, name: str) -> None:
    module.output_quant = ActQuant(spec, f"{name} output")
    module.register_forward_hook(_quant_output)


def restore_simulated(model: nn.Module, scheme: SimulatedScheme, manifest: Manifest | None = None) -> nn.Module:
    """Attach frozen quantizers only, for loading a saved quantized model (weights come from the file):
    a rotation's structure is rebuilt, ``keep=auto`` takes the modules the manifest names."""
    found = manifest.mitigation.keep if manifest is not None and manifest.mitigation is not None else None
    if "auto" in scheme.keep:
        if found is None:
            raise InputError(
                f"{scheme}: the manifest does not say which modules keep=auto kept; quantize the model "
                f"again and save it with this version of quantgate"
            )
        scheme = dataclasses.replace(scheme, keep=tuple(found))
    if scheme.rotate != "none":  # the saved config records the rotation and quantization being rebuilt
        saved = record_of(model)
        set_record(model, rotation=None, quantization=None)  # rotate_ refuses a model that records either
        rotate_(model, online=scheme.rotate == "online")
        set_record(model, rotation=saved.rotation or record_of(model).rotation, quantization=saved.quantization)
    return apply_simulated(model, scheme, None, skeleton=True)


def export_simulated(model: nn.Module, scheme: SimulatedScheme) -> tuple[str, str]:
    """compressed-tensors where it holds the scheme as quantgate simulates it, else quantgate's own format with
    why."""
    why = not_held(model, scheme)
    return (QUANTGATE.name, why) if why else (COMPRESSED_TENSORS.name, "")


@handles(SimulatedScheme, restore=restore_simulated, export=export_simulated, formats=(COMPRESSED_TENSORS,))
def apply_simulated(
    model: nn.Module, scheme: SimulatedScheme, calibrate: Calibrate | None, *, skeleton: bool = False
) -> nn.Module:
    """Quantize ``model`` in place. ``calibrate(model)`` runs the calibration batches (None: the scheme
    needs none); ``skeleton`` only attaches frozen quantizers (:func:`restore_simulated`). The scheme's
    mitigations run first (:mod:`quantgate.quant.mitigate`); what they did is recorded in
    ``model.config.quantgate["mitigation"]``."""
    if not skeleton:
        scheme = _mitigate(model, scheme, calibrate)
    if scheme.weight is not None and not skeleton:
        w = scheme.weight
        for _, linear in quantizable_linears(model, scheme):
            linear.weight.data, scale, zero = quantize_weight_qparams(  # in place: no second copy of the weights
                linear.weight.data, w.format, w.granularity, w.symmetric, w.group_size, w.estimator, inplace=True
            )
            if scale is not None and zero is not None:  # the grid, for checkpoints in other tools' formats
                setattr(linear, WEIGHT_QPARAMS, (scale, zero))
            trim()  # the free pages between the scales kept and the temporaries freed (quant.heap)
        if scheme.acts == "bondarenko":
            _quantize_tables(model, scheme, w)
    if scheme.act is not None:
        PLACEMENTS[scheme.acts](model, scheme, scheme.act)
    if scheme.kv is not None:
        _place_kv(model, scheme.kv, scheme.sink)
    quantizers = act_quantizers(model)
    if skeleton:
        for q in quantizers:
            q.calibrating, q.observer = False, None
    elif any(q.calibrating for q in quantizers):
        with _token_shapes(model, [q for q in quantizers if q.calibrating and q.spec.calib_skip]):
            needed(calibrate, scheme)(model)
        for q in quantizers:
            q.freeze()
    elif calibrate is not None and scheme.export_calibration:
        calibrate(model)  # NVFP4 activations: their maxima, the static global scales of a compressed-tensors export
    return model


@contextlib.contextmanager
def _token_shapes(model: nn.Module, quantizers: list[ActQuant]) -> Iterator[None]:
    """While calibrating, tell ``quantizers`` (those with ``calib_skip``) the (B, N) of each batch that
    enters ``model`` (its ``input_ids``, or ``inputs_embeds``), so they find the sequence axis."""
    if not quantizers:
        yield
        return

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            for q in quantizers:
                q.tokens = (ids.shape[0], ids.shape[1])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        for q in quantizers:
            q.tokens = None


def _mitigate(model: nn.Module, scheme: SimulatedScheme, calibrate: Calibrate | None) -> SimulatedScheme:
    """Rotate, then the fixes every backend applies (:func:`~quantgate.quant.mitigate.mitigate`: smooth,
    keep=auto); returns the scheme with the kept modules named."""
    rotation = rotate_(model, online=scheme.rotate == "online") if scheme.rotate != "none" else None
    return mitigate(model, scheme, calibrate, rotation)


def _place_kv(model: nn.Module, spec: TensorQuant, sink: int) -> None:
    """KV-cache quantizers (``spec``, the first ``sink`` tokens kept) on every attention's keys and values,
    after any activation quantizer there."""
    names = {id(m): n for n, m in model.named_modules()}
    for attn in attention_modules(model):
        fake_quant = cast("nn.ModuleDict | None", attn.qg_fake_quant)  # set by apply_variant
        present: dict[str, nn.Module] = dict(fake_quant.items()) if fake_quant else {}
        kv = {role: KVQuant(spec, f"{names[id(attn)]} cache {role}", role, sink) for role in ("k", "v")}
        attn.qg_fake_quant = nn.ModuleDict(
            {**present, **{r: nn.Sequential(present[r], q) if r in present else q for r, q in kv.items()}}
        )


def _place_linear_inputs(model: nn.Module, scheme: SimulatedScheme, act: TensorQuant) -> None:
    for name, linear in quantizable_linears(model, scheme):
        _on_input(linear, act, name)


def _place_bondarenko(model: nn.Module, scheme: SimulatedScheme, act: TensorQuant) -> None:
    """The reference's sites (module docstring), found through the model's Family."""
    family, base = family_of(model), cast(PreTrainedModel, model).base_model
    names = {id(m): n for n, m in model.named_modules()}
    kept = kept_modules(model, scheme)

    def found(owner: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
        modules = filter(None, (find_submodule(owner, p) for p in paths))
        return [m for m in modules if names[id(m)] not in kept]

    def inputs(owner: nn.Module, *paths: str, inplace: bool = False) -> None:
        for module in found(owner, paths):
            _on_input(module, act, names[id(module)], inplace)

    def outputs(owner: nn.Module, *paths: str) -> None:
        for module in found(owner, paths):
            _on_output(module, act, names[id(module)])

    if family.embed_sum:
        inputs(base, family.embed_sum)
    outputs(base, *family.outer_outputs)
    pre_norm = family.is_pre_norm(config_of(model))
    for block in family.blocks(model):
        if pre_norm:  # residual sum 1 enters the FFN norm and, as the same tensor, the block's second sum
            inputs(block, family.ffn_norm, inplace=True)
            _on_output(block, act, names[id(block)])  # residual sum 2
        else:  # the norms take the residual sums
            inputs(block, family.attn_norm, family.ffn_norm)
        outputs(block, family.attn_norm, family.ffn_norm, *family.branches)
        inputs(block, *family.inner_inputs)
    per_tensor = dataclasses.replace(act, granularity="tensor")  # (B, H, N, .) tensors: one range each
    for attn in attention_modules(model):
        attn.qg_fake_quant = nn.ModuleDict(
            {k: ActQuant(per_tensor, f"{names[id(attn)]} {k}", seq_dim=2) for k in ("q", "k", "v", "scores", "probs")}
        )
        if scheme.gates and hasattr(attn, "gate"):  # each gate Linear's input and output (the sigmoid input)
            gate = cast(nn.Module, attn.gate)
            for name, linear in gate.named_modules(prefix=names[id(gate)]):
                if isinstance(linear, nn.Linear):
                    _on_input(linear, act, name)
                    _on_output(linear, act, name)


PLACEMENTS: dict[str, Callable[[nn.Module, SimulatedScheme, TensorQuant], None]] = {
    "linear-inputs": _place_linear_inputs,
    "bondarenko": _place_bondarenko,
}


@torch.no_grad()
def _quantize_tables(model: nn.Module, scheme: SimulatedScheme, w: TensorQuant) -> None:
    """Embedding tables and norm weights, per tensor and symmetric as the reference quantizes them (the
    format, group size and estimator of the weights' spec ``w``), in place; an embedding tied to the
    full-precision head gets its own copy, the quantized one (the head keeps the float table)."""
    kept = kept_modules(model, scheme)
    head = cast(PreTrainedModel, model).get_output_embeddings()
    for name, module in model.named_modules():
        table = isinstance(module, nn.Embedding) or is_norm(module)
        if name in kept or not table or not isinstance(getattr(module, "weight", None), nn.Parameter):
            continue
        tied = head is not None and head.weight is module.weight
        q = quantize_weight(module.weight.data, w.format, "tensor", True, w.group_size, w.estimator, inplace=not tied)
        if tied:
            module.weight = nn.Parameter(q)
            config_of(model).tie_word_embeddings = False
        else:
            module.weight.data = q
        trim()


def act_quantizers(model: nn.Module) -> list[ActQuant]:
    return [m for m in model.modules() if isinstance(m, ActQuant)]


def check_ranges(model: nn.Module) -> None:
    """Raise ValueError naming the first quantizer whose static range is not finite."""
    for q in act_quantizers(model):
        if not bool(torch.isfinite(q.lo).all() & torch.isfinite(q.hi).all()):
            raise InputError(
                f"{q.name}: its range [{float(q.lo.min()):g}, {float(q.hi.max()):g}] is not finite, so "
                f"every output would be NaN; quantize the model again from calibration batches that "
                f"give finite activations"
            )
