"""The format ``qg.save`` writes a quantized model in, and the formats there are: each backend's own
(:class:`~quantgate.quant.formats.Format` entries its handler names, ``@handles(..., formats=...)``) and quantgate's.

A backend's handler picks the format of each model (its ``export``: ``(format, why)``): the simulated backend
writes compressed-tensors where that holds the scheme as quantgate simulates it
(:mod:`quantgate.quant.compressed_tensors`), torchao's handler transformers' torchao serialization for the configs
checked here, bitsandbytes' transformers' 8-bit one; these load in transformers, lm-eval's ``hf`` model and
vLLM. Everything else is saved in quantgate's own format (:data:`~quantgate.quant.formats.QUANTGATE`): Bondarenko's
residual and softmax sites, rotations, the KV-cache schemes, other widths and formats, gated / clipped / sink
attention, torchao's static int8 with per-Linear scales. config.json's model type then becomes ``quantgate`` so
that transformers, lm-eval and vLLM refuse the folder, naming quantgate, instead of building a different model
(:func:`quantgate.models.io.mark_quantgate_only`).

quantization.json stays beside the weights as the provenance sidecar in every format.
"""

from __future__ import annotations

import torch.nn as nn

from ..errors import InputError
from ..models.swap import variant_of
from . import backends  # noqa: F401  (with simulate, it registers the handlers handler_for looks up)
from .formats import QUANTGATE, Format
from .schemes import HANDLERS, Scheme, handler_for

__all__ = ["export_format", "compute_dtype", "format_of", "formats"]


def export_format(model: nn.Module, scheme: Scheme) -> tuple[str, str]:
    """``(format, why)``: the format :func:`quantgate.save` writes ``model`` (quantized with ``scheme``) in,
    and, for ``quantgate``, why no other tool's format holds it: a gated model's own, else what the scheme's
    backend says (its handler's ``export``)."""
    variant = variant_of(model)
    if variant is not None and not variant.is_vanilla:
        return QUANTGATE.name, f"its attention is {variant}, which transformers' {type(model).__name__} lacks"
    return handler_for(scheme).export(model, scheme)


def format_of(scheme: Scheme, name: str) -> Format:
    """The format ``name`` of ``scheme``'s backend (quantgate's own, or one its handler names); InputError naming
    the backend's formats for another."""
    known = {f.name: f for f in (QUANTGATE, *handler_for(scheme).formats)}
    if name not in known:
        raise InputError(f"{scheme.name} is saved in one of the formats {', '.join(known)}, not {name!r}")
    return known[name]


def formats() -> dict[str, Format]:
    """Every format a registered backend writes, by name (quantgate's own first)."""
    out = {QUANTGATE.name: QUANTGATE}
    for handler in HANDLERS.values():
        out.update({f.name: f for f in handler.formats})
    return out


def compute_dtype(model: nn.Module, scheme: Scheme) -> str:
    """The dtype config.json names for transformers to build the model in (:meth:`Scheme.export_dtype`)."""
    return str(scheme.export_dtype(next(model.parameters()).dtype)).removeprefix("torch.")
