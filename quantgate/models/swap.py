"""Swap an attention variant into a transformers model, keeping its q/k/v/o projections.

The family's attention module keeps its own forward (projections, RoPE, KV cache); its class gains a
small mixin that remembers the block input x for the gates, and the model's attention
implementation becomes ``"quantgate"``: a function registered with transformers'
``AttentionInterface`` (and the boolean SDPA mask with ``AttentionMaskInterface``, so padded
batches are masked) that runs :func:`gated_sdpa` with the module's gate, clip and sinks.
G2 (value) and G5 (output) gates ride on forward hooks of the v/o projections.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn as nn
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention.gates import build_gate
from ..attention.sdpa import BACKENDS, gated_sdpa
from ..errors import InputError
from ..variants import GATE_KINDS, AttentionVariant, VariantLike
from .families import Family, config_of, family_of
from .record import record_of, set_record

__all__ = [
    "ATTN_IMPLEMENTATION",
    "apply_variant",
    "variant_of",
    "set_backend",
    "gate_parameters",
    "attention_modules",
    "check_expressible",
    "replace_module",
    "SinkObserver",
]

log = logging.getLogger("quantgate")
ATTN_IMPLEMENTATION = "quantgate"


class SinkObserver(Protocol):
    """What the attention asks of an observer set as ``module.qg_observer`` (:func:`quantgate.observe` sets one,
    so do the experiments' first-token probes): how many first keys to measure, and where to send the
    attention mass on them, (B, Hq, N) per call."""

    sink_tokens: int

    def record_sink_mass(self, module: nn.Module, mass: torch.Tensor) -> None: ...


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: (B, H, N, D) in, (B, N, H, D) out, like ``sdpa_attention_forward``."""
    variant: AttentionVariant = module.qg_variant
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = bool(is_causal and q_len > 1 and attention_mask is None)
    if is_causal and kv_len > q_len:  # prefill into an empty static cache: the extra keys are unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    gate = getattr(module, "gate", None)
    if gate is not None and gate.position != "sdpa":
        gate = None
    multiplier = gate(module._qg_input) if gate is not None and not gate.needs_output else None
    observer: SinkObserver | None = module.qg_observer  # set while an observer runs: asks for the sink mass
    found = gated_sdpa(
        query,
        key,
        value,
        multiplier,
        attn_mask=attention_mask,
        is_causal=is_causal,
        scale=scaling,
        clip=variant.clip.params(key.shape[2]) if variant.clip else None,
        sinks=getattr(module, "sinks", None),
        dropout_p=dropout,
        backend=module.qg_backend,
        sink_tokens=observer.sink_tokens if observer is not None else 0,
        fake_quant=module.qg_fake_quant,  # simulated quantization of q/k/v and softmax in/out, when set
    )
    if observer is not None:  # asked for the sink mass: (output, mass)
        out, mass = cast(tuple[torch.Tensor, torch.Tensor], found)
        observer.record_sink_mass(module, mass)
    else:
        out = cast(torch.Tensor, found)
    if gate is not None and gate.needs_output:
        out = out * gate(module._qg_input, out)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


if TYPE_CHECKING:  # the mixin always comes before a family's attention class, an nn.Module
    _AttentionBase = nn.Module
else:
    _AttentionBase = object


class VariantAttention(_AttentionBase):
    """Mixin for a family's attention class: keeps the block input x while the block runs."""

    # set by apply_variant (and by the observers, simulated quantization and set_backend later)
    qg_variant: AttentionVariant
    qg_backend: str
    qg_observer: SinkObserver | None
    qg_fake_quant: nn.ModuleDict | None
    _qg_input: torch.Tensor | None
    _qg_output_gate: torch.Tensor | None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gate = getattr(self, "gate", None)
        self._qg_input = hidden_states
        if gate is not None and gate.position == "output":
            self._qg_output_gate = gate(hidden_states)  # consumed by the o_proj hook
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self._qg_input = None

    def extra_repr(self) -> str:
        return f"variant={self.qg_variant}, backend={self.qg_backend}"


_MIXED: dict[type, type] = {}


def _variant_class(cls: type) -> type:
    if issubclass(cls, VariantAttention):
        return cls
    if cls not in _MIXED:
        _MIXED[cls] = type(cls.__name__, (VariantAttention, cls), {"__module__": __name__})
    return _MIXED[cls]


def _value_gate_hook(proj, inputs, output):
    return output * proj._qg_owner.gate(inputs[0])


def _output_gate_hook(proj, inputs, output):
    owner = proj._qg_owner
    multiplier, owner._qg_output_gate = owner._qg_output_gate, None
    return output * multiplier


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of every softmax-attention block, in order."""
    family = family_of(model)
    return [block.get_submodule(family.attention) for block in family.attention_blocks(model)]


def variant_of(model_or_config: nn.Module | PreTrainedConfig) -> AttentionVariant | None:
    """The variant recorded on a model (or its config), or None when quantgate has not touched it."""
    variant = record_of(model_or_config).variant
    return AttentionVariant.parse(variant) if variant is not None else None


def native_variant(family: Family) -> AttentionVariant:
    return AttentionVariant.parse(family.native_gate)


def apply_variant(
    model: nn.Module,
    variant: VariantLike = None,
    *,
    backend: str = "auto",
    seed: int | None = None,
    announce: bool = True,
) -> nn.Module:
    """Swap ``variant`` into every attention block of ``model`` (in place) and return the model.

    New parameters (gates, sinks) are initialised as the variant says and listed in the log (``announce``;
    a loader that replaces them with a checkpoint's values at once passes False: they are not new there).
    ``variant=None`` keeps the architecture's own attention (vanilla, or its built-in gate).
    """
    family = family_of(model)
    variant = native_variant(family) if variant is None else AttentionVariant.parse(variant)
    current = variant_of(model)
    if current is not None:
        if current != variant:
            raise InputError(
                f"this model already has variant {current}; build or load a fresh model to use "
                f"{variant} (qg.load(path, variant=...) adds a gate to an ungated checkpoint)"
            )
        return set_backend(model, backend)
    config = config_of(model)
    check_expressible(family, variant, config)
    dims = family.dims(config)
    added: list[str] = []
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        for _i, block in enumerate(family.attention_blocks(model)):
            module = block.get_submodule(family.attention)
            ref = cast(torch.Tensor, block.get_submodule(family.o_proj).weight)  # device, dtype of new parameters
            module.__class__ = _variant_class(type(module))
            attn = cast(VariantAttention, module)
            attn.qg_variant = variant
            attn.qg_observer = None
            attn.qg_fake_quant = None
            attn._qg_input = None
            gate_spec = variant.gate if variant.gate and variant.gate.kind != family.native_gate else None
            if gate_spec is not None:
                gate = build_gate(gate_spec, dims, family.init_std(config)).to(ref.device, ref.dtype)
                attn.gate = gate
                hooks = {"value": (family.v_proj, _value_gate_hook), "output": (family.o_proj, _output_gate_hook)}
                if gate.position in hooks:
                    path, hook = hooks[gate.position]
                    proj = block.get_submodule(path)
                    object.__setattr__(proj, "_qg_owner", attn)  # not a submodule: no duplicate parameters
                    proj.register_forward_hook(hook)
                added += [f"{family.attention}.gate.{n}" for n, _ in gate.named_parameters()]
            if variant.sink is not None:
                attn.sinks = nn.Parameter(
                    torch.full((dims.n_heads,), variant.sink.init, device=ref.device, dtype=ref.dtype)
                )
                added.append(f"{family.attention}.sinks")
    set_record(config, variant=str(variant), family=family.name)
    cast(PreTrainedModel, model).set_attn_implementation(ATTN_IMPLEMENTATION)
    set_backend(model, backend)
    if added and announce:
        n = sum(p.numel() for p in gate_parameters(model).values())
        init = (
            [f"gate at pi_init={variant.gate.pi_init}"]
            if variant.gate and variant.gate.kind != family.native_gate
            else []
        )
        init += [f"sinks at {variant.sink.init}"] if variant.sink else []
        log.info(
            "variant %s added %d new parameters (%s; %s)", variant, n, ", ".join(init), ", ".join(sorted(set(added)))
        )
    return model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` was (a quantized Linear for a float one), keeping what the swap attached to
    the old module: its hooks (G2/G5 gates ride on them) and the attention that owns its gate."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    new._forward_hooks.update(old._forward_hooks)
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    if "_qg_owner" in old.__dict__:
        object.__setattr__(new, "_qg_owner", old._qg_owner)
    setattr(parent, child, new)


def check_expressible(family: Family, variant: AttentionVariant, config: PreTrainedConfig) -> None:
    """Raise ValueError when ``variant`` cannot be swapped into a ``family`` model of ``config``."""
    if family.native_gate and (variant.gate is None or variant.gate.kind != family.native_gate):
        raise InputError(
            f"{family.name} has a built-in {family.native_gate} gate (part of q_proj); its variant is "
            f"'{family.native_gate}', optionally with +clipped or +sink, not {variant}"
        )
    if not family.value_gate and variant.gate is not None and GATE_KINDS[variant.gate.kind].gate.position == "value":
        raise InputError(
            f"{family.name}: {variant.gate.kind} gates each key token's values, but this architecture rebuilds "
            f"keys and values from a cached latent at every decoding step, where the key tokens' hidden "
            f"states are gone; use a G1 gate (g1-elementwise is Kimi's channel-wise output gate)"
        )
    if family.native_gate and variant.gate is not None and variant.gate.low_rank is not None:
        raise InputError(f"{family.name}'s built-in gate is full rank; drop low_rank from {variant}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t not in ("full_attention", "attention") for t in layer_types):
        log.warning(
            "%s: variant %s applies to the %d full-attention blocks only (others: %s)",
            family.name,
            variant,
            sum(t == "full_attention" for t in layer_types),
            sorted(set(layer_types) - {"full_attention"}),
        )


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Choose the gated_sdpa backend ("auto", "eager", "sdpa", "triton") for every attention block."""
    if backend not in BACKENDS:
        raise InputError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    for attn in attention_modules(model):
        cast(VariantAttention, attn).qg_backend = backend
    return model


def gate_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters added by the variant: the attention gates (``...<attention>.gate...``) and learned sinks.

    MoE routers and MLP ``gate_proj`` weights also carry "gate" in their names; they are not included.
    """
    owners = {id(attn) for attn in attention_modules(model)}
    out: dict[str, nn.Parameter] = {}
    for name, module in model.named_modules():
        if id(module) in owners:
            out.update(
                {f"{name}.{n}": p for n, p in module.named_parameters() if n.startswith("gate.") or n == "sinks"}
            )
    return out
