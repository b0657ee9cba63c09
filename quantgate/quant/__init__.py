"""Post-training quantization: one verb, a scheme, a registry of handlers.

q_model = qg.quantize(model, "w8a8-int8-static", calibration=batches)   # a quantized copy
qg.quant_error(model, q_model, batches)                                  # per-layer SQNR
qg.quant.site_sensitivity(q_model, batches)                              # loss each act. site costs
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import cast

import torch
import torch.nn as nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..models.families import config_of
from ..models.modes import eval_mode
from ..models.swap import apply_variant, variant_of
from ..options import printed
from . import backends, simulate  # noqa: F401  (imported for their effect: they register the schemes' handlers)
from .error import quant_error, site_sensitivity
from .schemes import HANDLERS, SCHEMES, Scheme, SimulatedScheme, TorchaoScheme, get_scheme, handler_for

__all__ = [
    "quantize",
    "quant_error",
    "site_sensitivity",
    "SCHEMES",
    "Scheme",
    "get_scheme",
    "quantization_of",
    "HANDLERS",
    "handler_for",
    "HardwareUnavailable",
]

log = logging.getLogger("quantgate")


class HardwareUnavailable(RuntimeError):
    """The scheme needs hardware this machine lacks (e.g. an FP8-capable GPU); the message names an alternative."""


def quantize(
    model: nn.Module,
    scheme: str | Scheme,
    calibration: Iterable[Mapping[str, torch.Tensor]] | None = None,
    *,
    inplace: bool = False,
    **options: object,
) -> nn.Module:
    """Quantize ``model`` with ``scheme`` (a name from ``SCHEMES``, optionally ``name:key=value,...``);
    ``options`` are the same keys as keyword arguments. Static schemes read ``scheme.calib`` batches
    from ``calibration`` (an iterable of model-input dicts). Returns a quantized copy, or the model
    itself when ``inplace``; the source model is never modified otherwise. NaN or inf in the weights or
    the calibration activations is refused (ValueError naming the tensor)."""
    scheme = _with_options(get_scheme(scheme), options)
    if scheme.needs_cuda and not _cuda_fp8():
        raise HardwareUnavailable(f"{scheme.name} cannot run here: {scheme.needs_cuda}")
    if scheme.needs_calibration and calibration is None:
        raise ValueError(f"{scheme} uses static activation ranges: pass calibration batches (calibration=...)")
    _check_finite(model)
    fingerprint = _fingerprint(model)
    target = model if inplace else copy.deepcopy(model)
    if variant_of(target) is None:
        apply_variant(target)
    seen: dict[str, int] = {}

    def calibrate(m: nn.Module) -> None:
        assert isinstance(scheme, (SimulatedScheme, TorchaoScheme))  # the schemes that calibrate
        seen.update(_calibrate(m, calibration, scheme.calib))

    handler_for(scheme).apply(target, scheme, calibrate)
    meta = config_of(target).quantgate
    meta["quantization"] = {
        "scheme": str(scheme),
        "calibration": {
            **seen,
            "source": getattr(calibration, "split", None),
            "seq_len": getattr(calibration, "seq_len", None),
        }
        if seen
        else None,
        "source_model": getattr(model.config, "_name_or_path", None) or None,
        "source_sha256": fingerprint,
    }
    mitigation = meta.pop("mitigation", None)
    if mitigation:
        meta["quantization"]["mitigation"] = mitigation
    return target


def quantization_of(model: nn.Module) -> dict | None:
    """The quantization record of a model made by :func:`quantize` (None for a float model)."""
    return (getattr(model.config, "quantgate", None) or {}).get("quantization")


def _with_options(scheme: Scheme, options: dict[str, object]) -> Scheme:
    if not options:
        return scheme
    text = str(scheme)
    extra = ",".join(f"{k}={printed(tuple(v) if isinstance(v, list) else v)}" for k, v in options.items())
    return get_scheme(text + ("," if ":" in text else ":") + extra)


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@torch.no_grad()
def _calibrate(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]] | None, n: int) -> dict[str, int]:
    """Run up to ``n`` batches through ``model`` (eval mode); checks the batches fit the model."""
    vocab = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).num_embeddings
    device = next(model.parameters()).device
    count = tokens = 0
    with eval_mode(model):
        for batch in tqdm(batches, total=n, desc="calibrate", leave=False, disable=None):
            if count >= n:
                break
            ids = batch["input_ids"]
            if int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise ValueError(
                    f"calibration batch has token id {int(ids.max())} but the model's vocabulary has "
                    f"{vocab} entries: the batches come from another tokenizer; build them with "
                    f"qg.tokenizer(model)"
                )
            model(**{k: v.to(device) for k, v in batch.items() if k != "labels"})
            count += 1
            tokens += ids.numel()
    if count == 0:
        raise ValueError("the calibration set is empty: give at least one batch")
    return {"batches": count, "tokens": tokens}


def _check_finite(model: nn.Module) -> None:
    """Refuse NaN or inf weights: their quantized copy would be as broken, behind a normal manifest."""
    for name, p in model.named_parameters():
        if type(p.data) is torch.Tensor and p.is_floating_point():
            bad = int((~torch.isfinite(p.detach())).sum())
            if bad:
                raise ValueError(
                    f"{name} holds {bad} NaN or inf value{'s' if bad > 1 else ''}: the float model is "
                    f"broken (diverged training or a corrupt checkpoint); quantize a model whose "
                    f"weights are all finite"
                )


def _fingerprint(model: nn.Module) -> str:
    """sha256 over the model's parameters and buffers (names, shapes, bytes)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        t = t.detach()
        if type(t) is torch.Tensor and t.numel():  # plain tensors; quantized subclasses hash by name and shape
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        h.update(str(tuple(t.shape)).encode())
    return h.hexdigest()
