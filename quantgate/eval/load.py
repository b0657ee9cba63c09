"""The model an evaluation loads: ``quantgate eval SOURCE [--variant V] [--scheme S]`` and lm-eval's ``--model
quantgate`` / ``quantgate-mlm`` (:mod:`quantgate.eval.lm_eval_models`) load it alike, and its context length."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..data import batches
from ..errors import InputError
from ..model_files import load_or_build
from ..models.families import config_of, family_of
from ..models.io import Placement
from ..models.sources import tokenizer as get_tokenizer
from ..quant import get_scheme, quantization_of, quantize

__all__ = ["load_for_eval", "context_length", "CALIB_SOURCE", "CALIB_SEQ_LEN", "CALIB_BATCH_SIZE"]

CALIB_SOURCE, CALIB_SEQ_LEN, CALIB_BATCH_SIZE = "train", 128, 8  # what --scheme calibrates on (eval, lm-eval)


def load_for_eval(
    source: str,
    variant: str | None = None,
    scheme: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    placement: Placement | None = None,
) -> nn.Module:
    """The model ``quantgate eval SOURCE [--variant V] [--scheme S]`` evaluates, and lm-eval's ``--model
    quantgate`` / ``quantgate-mlm`` load: a packaged checkpoint or directory through :func:`quantgate.load`
    (float or quantized), another preset name built fresh (seed 0); with ``scheme``, quantized after
    calibrating on the train split (128-token sequences, batches of 8: ``CALIB_*``), in place (the float model is
    not needed again); ``placement`` shards a checkpoint as it loads."""
    if scheme is not None:
        get_scheme(scheme)  # an unknown scheme or option fails before the model loads
    model = load_or_build(source, variant, dtype=dtype, placement=placement)
    if device is not None:
        model = model.to(device)
    record = quantization_of(model) if scheme is not None else None
    if record is not None:
        source_model = record.source_model
        raise InputError(
            f"{source} is already quantized ({record.scheme}); scheme (--scheme) quantizes a float model: "
            f"evaluate {source} as it is, without a scheme, or give its float source"
            + (f" ({source_model})" if source_model else "")
            + " with the scheme"
        )
    if scheme is not None:
        family = family_of(model)
        family.check_seq_len(config_of(model), CALIB_SEQ_LEN)
        calib = batches(get_tokenizer(model), CALIB_SOURCE, CALIB_SEQ_LEN, CALIB_BATCH_SIZE, family.objective)
        model = quantize(model, scheme, calibration=calib, inplace=True)
    return model


def context_length(model: nn.Module) -> int:
    """The tokens an evaluation's window holds by default: the model's positions, at most 4096."""
    return int(min(getattr(model.config, "max_position_embeddings", 2048) or 2048, 4096))
