"""Simulated (fake) quantization wired into a model: weights are replaced by their quantized values,
activations pass through :class:`ActQuant` modules attached where the scheme says.

* ``linear-inputs``: the input of every nn.Linear except the kept ones (the LM head by default);
* ``everything`` (Bondarenko et al.): also embedding outputs (and embedding weights), norm outputs,
  the residual stream after each block, the attention's q, k, v, softmax input (scores) and
  softmax output (probabilities). Softmax quantization runs on gated_sdpa's eager backend.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.nn as nn

from ..models.families import family_of
from ..models.swap import attention_modules
from .quantizers import fake_quant, quantize_weight, RangeObserver
from .schemes import Scheme, TensorQuant  # noqa: F401  (TensorQuant: the ActQuant spec type)

__all__ = ["ActQuant", "apply_simulated", "act_quantizers", "check_ranges", "kept_modules", "quantizable_linears"]


class ActQuant(nn.Module):
    """Fake-quantizes the tensors that flow through it.

    While ``calibrating`` it only observes (ranges for static quantization); afterwards it quantizes
    with the frozen range (buffers ``lo``/``hi``, a scalar or one value per channel), or with ranges
    taken from each tensor when the spec is dynamic (per tensor or per token). It counts FP8
    saturation (``overflow`` of ``values``) and, when ``track`` is on, the signal and noise energy
    behind its SQNR. ``name`` says which tensor it quantizes (``model.layers.0.mlp.up_proj input``).
    """

    def __init__(self, spec: TensorQuant, name: str):
        super().__init__()
        self.spec, self.name = spec, name
        self.register_buffer("lo", torch.zeros(()))
        self.register_buffer("hi", torch.zeros(()))
        self.calibrating = not spec.dynamic
        self.observer = RangeObserver(spec.estimator, spec.momentum, spec.percentile, name=name,
                                      per_channel=spec.granularity == "channel") if self.calibrating else None
        self.overflow = self.values = 0
        self.track = False
        self.signal = self.noise = 0.0
        self.ndim = None  # rank of the tensors seen (torchao static scales need it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ndim = x.dim()
        if self.calibrating:
            self.observer.update(x)
            return x
        if self.spec.dynamic:
            dims = -1 if self.spec.granularity == "token" else tuple(range(x.dim()))
            lo, hi = x.detach().amin(dim=dims, keepdim=True), x.detach().amax(dim=dims, keepdim=True)
        else:
            lo, hi = self.lo.to(x.dtype), self.hi.to(x.dtype)
        y, over = fake_quant(x, lo, hi, self.spec.format, self.spec.symmetric)
        self.overflow += over
        self.values += x.numel()
        if self.track:
            xd = x.detach().double()
            self.signal += float(xd.square().sum())
            self.noise += float((xd - y.detach().double()).square().sum())
        return y

    def freeze(self) -> None:
        """End calibration: fix the static range from what was observed."""
        if self.calibrating:
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
        return f"{s.format}, {'symmetric' if s.symmetric else 'asymmetric'}, {kind}"


def kept_modules(model: nn.Module, scheme: Scheme) -> set[str]:
    """Names of the modules left in full precision: the LM head and the scheme's ``keep`` patterns."""
    names = dict((id(m), n) for n, m in model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = {names[id(head)]} if head is not None and id(head) in names else set()
    kept |= {n for n in names.values() if any(fnmatch.fnmatch(n, p) for p in scheme.keep)}
    return kept


def quantizable_linears(model: nn.Module, scheme: Scheme) -> list[tuple[str, nn.Linear]]:
    kept = kept_modules(model, scheme)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in kept]


def _quant_input(module, args):
    return (module.input_quant(args[0]), *args[1:])


def _quant_output(module, args, output):
    if isinstance(output, tuple):
        return (module.output_quant(output[0]), *output[1:])
    return module.output_quant(output)


def apply_simulated(model: nn.Module, scheme: Scheme, calibrate, *, skeleton: bool = False) -> nn.Module:
    """Quantize ``model`` in place. ``calibrate(model)`` runs the calibration batches; ``skeleton``
    only attaches frozen quantizers (for loading a saved quantized model: weights come from the file)."""
    for name, linear in quantizable_linears(model, scheme):
        if scheme.weight is not None and not skeleton:
            w = scheme.weight
            linear.weight.data = quantize_weight(linear.weight.data, w.format, w.granularity, w.symmetric,
                                                 w.group_size, w.estimator)
        if scheme.act is not None:
            linear.input_quant = ActQuant(scheme.act, f"{name} input")
            linear.register_forward_pre_hook(_quant_input)
    if scheme.act is not None and scheme.acts == "everything":
        _quantize_everything(model, scheme, skeleton)
    quantizers = act_quantizers(model)
    if skeleton:
        for q in quantizers:
            q.calibrating, q.observer = False, None
    elif any(q.calibrating for q in quantizers):
        calibrate(model)
        for q in quantizers:
            q.freeze()
    return model


def _quantize_everything(model: nn.Module, scheme: Scheme, skeleton: bool) -> None:
    """Bondarenko et al.'s 'everything': embeddings, norm outputs, residual sums, softmax in/out, q/k/v."""
    family = family_of(model)
    act = scheme.act
    kept = kept_modules(model, scheme)
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if name in kept:
            continue
        is_norm = type(module).__name__.endswith("Norm") or isinstance(module, nn.LayerNorm)
        if isinstance(module, nn.Embedding) or is_norm:
            module.output_quant = ActQuant(act, f"{name} output")
            module.register_forward_hook(_quant_output)
        if isinstance(module, nn.Embedding) and scheme.weight is not None and not skeleton:
            if head is not None and head.weight is module.weight:  # tied to the full-precision LM head: untie
                module.weight = nn.Parameter(module.weight.detach().clone())
                model.config.tie_word_embeddings = False
            w = scheme.weight
            module.weight.data = quantize_weight(module.weight.data, w.format, "tensor", True, w.group_size,
                                                 w.estimator)
    names = {id(m): n for n, m in model.named_modules()}
    for block in family.blocks(model):
        block.output_quant = ActQuant(act, f"{names[id(block)]} output")
        block.register_forward_hook(_quant_output)
    per_tensor = dataclasses.replace(act, granularity="tensor")  # (B, H, N, .) tensors: one range each
    for attn in attention_modules(model):
        attn.qg_fake_quant = nn.ModuleDict({k: ActQuant(per_tensor, f"{names[id(attn)]} {k}")
                                            for k in ("q", "k", "v", "scores", "probs")})


def act_quantizers(model: nn.Module) -> list[ActQuant]:
    return [m for m in model.modules() if isinstance(m, ActQuant)]


def check_ranges(model: nn.Module) -> None:
    """Raise ValueError naming the first quantizer whose static range is not finite."""
    for q in act_quantizers(model):
        if not bool(torch.isfinite(q.lo).all() & torch.isfinite(q.hi).all()):
            raise ValueError(f"{q.name}: its range [{float(q.lo.min()):g}, {float(q.hi.max()):g}] is not finite, so "
                             f"every output would be NaN; quantize the model again from calibration batches that "
                             f"give finite activations")
