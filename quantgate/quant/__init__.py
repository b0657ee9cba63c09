"""Post-training quantization: one verb, a scheme, a registry of handlers.

q_model = qg.quantize(model, "w8a8-int8-static", calibration=batches)   # a quantized copy
qg.quant_error(model, q_model, batches)                                  # per-layer SQNR
qg.quant.site_sensitivity(q_model, batches)                              # loss each act. site costs
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..data.batches import cache_dir
from ..errors import InputError, Unavailable
from ..files import content_sha256
from ..models.io import offloaded
from ..models.modes import eval_mode
from ..models.record import CalibrationRecord, QuantizationRecord, record_of, set_record
from ..models.swap import apply_variant, variant_of
from ..options import printed
from . import backends, imported, simulate  # noqa: F401  (backends and simulate register the handlers quantize looks up)
from .error import QuantError, SiteSensitivity, quant_error, site_sensitivity
from .heap import trimming
from .imported import ImportedQuantization
from .schemes import (
    HANDLERS,
    SCHEMES,
    CalibratedScheme,
    Scheme,
    get_scheme,
    handler_for,
)

__all__ = [
    "quantize",
    "quant_error",
    "QuantError",
    "site_sensitivity",
    "SiteSensitivity",
    "SCHEMES",
    "Scheme",
    "get_scheme",
    "quantization_of",
    "Quantization",
    "HANDLERS",
    "handler_for",
    "HardwareUnavailable",
]

log = logging.getLogger("quantgate")

# a model's quantization as :func:`quantization_of` reads it, whoever made it: each names it (``scheme``), its maker
# (``origin``) and the float model it came from where known (``source_model``, ``source_sha256``), and writes itself
# as JSON after its origin (``with_origin()``)
Quantization = QuantizationRecord | ImportedQuantization


class HardwareUnavailable(Unavailable):
    """The scheme needs hardware this machine lacks (e.g. an FP8-capable GPU); the message names an alternative."""


def quantize(
    model: nn.Module,
    scheme: str | Scheme,
    calibration: Iterable[Mapping[str, torch.Tensor]] | None = None,
    *,
    inplace: bool = False,
    dequantize: bool = False,
    **options: object,
) -> nn.Module:
    """Quantize ``model`` with ``scheme`` (a name from ``SCHEMES``, optionally ``name:key=value,...``);
    ``options`` are the same keys as keyword arguments. Static schemes read ``scheme.calib`` batches
    from ``calibration`` (an iterable of model-input dicts); the record's ``calibration`` says how many ran
    (``batches``, of ``requested``: fewer where the iterable ran out, which is logged). Returns a quantized
    copy, or the model itself when ``inplace``; the source model is never modified otherwise. NaN or inf in
    the weights or the calibration activations is refused (ValueError naming the tensor), and so is a model
    that is already quantized (:func:`quantization_of`), unless ``dequantize`` and it is a compressed-tensors or
    bitsandbytes one: then its weights are first decompressed to float by that library (a copy, unless
    ``inplace``) and the new record names the quantization it had (``dequantized_from``)."""
    scheme = _with_options(get_scheme(scheme), options)
    if on_disk := offloaded(model):
        raise InputError(
            f"{len(on_disk)} weights of this model (first {on_disk[0]}) were placed on disk by its device_map: "
            f"quantization reads and replaces every weight, so they must be in memory. Load it with max_memory "
            f"room for the model on the GPUs and CPU (no disk), and quantize in place (inplace=True) where a copy "
            f"would not fit"
        )
    existing = quantization_of(model)
    dequantized_from = None
    if existing is not None:
        if not (dequantize and isinstance(existing, ImportedQuantization) and existing.dequantizable):
            raise InputError(_already_quantized(existing, dequantize))
        model = imported.dequantize_(model if inplace else copy.deepcopy(model))
        dequantized_from, inplace = existing.scheme, True
    elif dequantize:
        raise InputError("dequantize=True: this model is not quantized; leave dequantize out")
    if scheme.needs_cuda and not _cuda_fp8():
        raise HardwareUnavailable(f"{scheme.name} cannot run here: {scheme.needs_cuda}")
    if scheme.needs_calibration and calibration is None:
        raise InputError(f"{scheme} uses static activation ranges: pass calibration batches (calibration=...)")
    _check_finite(model)
    simulate.check_keep(model, scheme)  # before the model is copied or changed
    source_sha256 = fingerprint(model)
    target = model if inplace else copy.deepcopy(model)
    if variant_of(target) is None:
        apply_variant(target)
    ran: CalibrationRecord | None = None  # the last calibration's

    def calibrate(m: nn.Module) -> None:
        nonlocal ran
        assert isinstance(scheme, CalibratedScheme)  # the schemes that calibrate
        ran = _calibrate(m, calibration, scheme.calib, trim=inplace)

    handler_for(scheme).apply(target, scheme, calibrate if calibration is not None else None)
    source_model, source_files = _source(getattr(model.config, "_name_or_path", None) or None)
    quantization = QuantizationRecord(
        scheme=str(scheme),
        calibration=ran,
        source_model=source_model,
        source_sha256=source_sha256,
        source_files_sha256=source_files,
        dequantized_from=dequantized_from,
        mitigation=record_of(target).mitigation,
    )
    set_record(target, quantization=quantization, mitigation=None)
    return target


def source_files_sha256(folder: str | Path) -> str:
    """sha256 of a model folder's config.json and weights (:func:`~quantgate.files.content_sha256`)."""
    return content_sha256(folder, patterns=("config.json", "*.safetensors"), memo=cache_dir() / "content-sha256.json")


def _source(name: str | None) -> tuple[str | None, str | None]:
    """The float model a quantized one comes from, as its record names it: ``(source_model,
    source_files_sha256)``, its name as given (a packaged name, a hub id) and None, or for a folder its absolute
    path and the hash of its files, so that no reader takes another folder of the same name (a relative path means
    another folder in another working directory) for it."""
    if name is None or not Path(name).is_dir():
        return name, None
    return str(Path(name).resolve()), source_files_sha256(name)


def quantization_of(model: nn.Module) -> Quantization | None:
    """The quantization record of ``model``, None for a float model: for a model made by :func:`quantize`,
    quantgate's own (:class:`~quantgate.models.record.QuantizationRecord`, ``origin`` ``quantgate``); for one
    another tool quantized, the record of its ``quantization_config`` or its quantized tensors
    (:class:`~quantgate.quant.imported.ImportedQuantization`: ``origin`` the tool, e.g. ``compressed-tensors``).
    ``scheme`` names the quantization either way."""
    own = record_of(model).quantization
    return own if own is not None else imported.imported_quantization(model)


def _already_quantized(record: Quantization, dequantize: bool) -> str:
    """Why :func:`quantize` refuses a quantized model, and what to do instead."""
    scheme, origin = record.scheme, record.origin
    if isinstance(record, QuantizationRecord):
        source = record.source_model
        return (
            f"this model is already quantized ({scheme}); quantize() takes a float model: quantize its float "
            f"source{f' ({source})' if source else ''} with the new scheme instead"
            + (
                " (quantgate's own schemes round the weights in place: they cannot be dequantized)"
                if dequantize
                else ""
            )
        )
    where = "its config.json's quantization_config" if record.quantization_config is not None else "its tensors"
    text = (
        f"this model is already quantized ({scheme}, from {where}); quantize() takes a float model: load "
        f"the float checkpoint it was made from and quantize that"
    )
    if record.dequantizable:
        return text + ", or pass dequantize=True to decompress its weights to float first"
    if dequantize:
        return text + f" ({origin} models cannot be dequantized here: only compressed-tensors and bitsandbytes ones)"
    return text


def _with_options(scheme: Scheme, options: dict[str, object]) -> Scheme:
    if not options:
        return scheme
    text = str(scheme)
    extra = ",".join(f"{k}={printed(tuple(v) if isinstance(v, list) else v)}" for k, v in options.items())
    return get_scheme(text + ("," if ":" in text else ":") + extra)


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@torch.no_grad()
def _calibrate(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]] | None, n: int, trim: bool = False
) -> CalibrationRecord:
    """Run up to ``n`` batches through ``model`` (eval mode); checks the batches fit the model. Returns what
    ran, for the quantization record: ``batches`` (those consumed: fewer than ``requested`` = ``n`` where the
    calibration set holds fewer, which is logged), ``tokens``, and the batches' split and sequence length where
    they say. ``trim``: the heap's free pages given back
    after each block (:mod:`.heap`), for in-place quantization's peak memory; it costs time (the next block
    faults its pages in again: the main job's static INT8 on SmolLM2 quantized in 5.9 s with it, 2.3 s without),
    so a copy, which holds twice the model anyway, runs without."""
    vocab = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).num_embeddings
    device = next(model.parameters()).device
    # nothing calibrates on the LM head's output (it stays in full precision) nor reads a KV cache back: the
    # logits of the last position only and no cache, where the model takes the options (transformers'
    # logits_to_keep, use_cache), not (tokens x vocabulary) floats and every layer's keys and values per batch
    try:
        takes = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature to read: nothing asked
        takes = set()
    lean = {k: v for k, v in {"logits_to_keep": 1, "use_cache": False}.items() if k in takes}
    count = tokens = 0
    with eval_mode(model), trimming(model) if trim else contextlib.nullcontext():
        for batch in tqdm(batches, total=n, desc="calibrate", leave=False, disable=None):
            if count >= n:
                break
            ids = batch["input_ids"]
            if int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise InputError(
                    f"calibration batch has token id {int(ids.max())} but the model's vocabulary has "
                    f"{vocab} entries: the batches come from another tokenizer; build them with "
                    f"qg.tokenizer(model)"
                )
            model(**{**lean, **{k: v.to(device) for k, v in batch.items() if k != "labels"}})
            count += 1
            tokens += ids.numel()
    if count == 0:
        raise InputError("the calibration set is empty: give at least one batch")
    if count < n:
        log.warning(
            "calibration: %d batch%s ran of the %d asked for (calib=%d): the calibration set holds no more; "
            "the quantization record says %d",
            count,
            "" if count == 1 else "es",
            n,
            n,
            count,
        )
    return CalibrationRecord(count, n, tokens, getattr(batches, "split", None), getattr(batches, "seq_len", None))


def _check_finite(model: nn.Module) -> None:
    """Refuse NaN or inf weights: their quantized copy would be as broken, behind a normal manifest."""
    for name, p in model.named_parameters():
        if type(p.data) is torch.Tensor and p.is_floating_point():
            bad = _nonfinite(p.detach())
            if bad:
                raise InputError(
                    f"{name} holds {bad} NaN or inf value{'s' if bad > 1 else ''}: the float model is "
                    f"broken (diverged training or a corrupt checkpoint); quantize a model whose "
                    f"weights are all finite"
                )


def _nonfinite(t: torch.Tensor) -> int:
    """How many values of ``t`` are NaN or inf, without a temporary the size of ``t`` when there are none:
    min and max propagate NaN and reach +-inf (``isfinite(t).sum()`` took 2.3x ``t``'s float32 bytes, and set
    the peak of quantizing in place). Only a tensor that holds some is counted, in blocks."""
    if not t.numel():
        return 0
    with contextlib.suppress(RuntimeError, NotImplementedError):  # dtypes without aminmax are counted below
        lo, hi = torch.aminmax(t)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return 0
    flat = t.reshape(-1)
    step = 1 << 22
    return sum(int((~torch.isfinite(flat[i : i + step])).sum()) for i in range(0, flat.numel(), step))


def fingerprint(model: nn.Module) -> str:
    """sha256 over the model's parameters and buffers (names, shapes, bytes; a tensor subclass, such as
    torchao's quantized weights, by the tensors it is made of)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        _hash_tensor(h, _in_offload(model, name) if t.device.type == "meta" else t.detach())
        h.update(str(tuple(t.shape)).encode())
    return h.hexdigest()


def _in_offload(model: nn.Module, name: str) -> torch.Tensor:
    """The weight ``name`` of a model whose device_map placed it on disk, read from accelerate's offload."""
    path, _, attr = name.rpartition(".")
    weights = getattr(getattr(model.get_submodule(path), "_hf_hook", None), "weights_map", None)
    if weights is None:
        raise InputError(f"{name} has no values (the meta device) and no offload holds it: the model is incomplete")
    return weights[attr]


def _hash_tensor(h: hashlib._Hash, t: torch.Tensor) -> None:
    if type(t) is torch.Tensor:
        if t.numel():
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().data)  # its buffer, not a copy
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten):  # a wrapper subclass: its inner tensors, by name
        for inner in flatten()[0]:
            value = getattr(t, inner, None)
            if isinstance(value, torch.Tensor):
                h.update(inner.encode())
                _hash_tensor(h, value.detach())
        return
    with contextlib.suppress(RuntimeError, TypeError):  # a plain subclass: its storage (else name and shape only)
        _hash_tensor(h, t.as_subclass(torch.Tensor))
