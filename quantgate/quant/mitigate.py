"""Post-hoc outlier fixes, applied to the float model before it is quantized (scheme options).

* ``smooth=ALPHA``: SmoothQuant (Xiao et al. 2023). For the input X (tokens x C) of a group of Linears
  with weights W_i (out_i x C), s_j = max|X_j|^a / max_i max|W_i[:, j]|^(1-a) over the calibration
  batches (torchao's ``RunningAbsMaxSmoothQuantObserver``, on the group's weights stacked); then
  X diag(s)^-1 . diag(s) W^T = X W^T exactly, with diag(s)^-1 folded into the op that makes X, so the
  smoothed model costs no parameter and no op. Groups of a pre-norm block: the attention norm's readers
  (q/k/v and the gate's input projection), the FFN norm's readers (gate/up, or fc1), and the FFN's
  down-projection, whose input act(gate) * up is linear in up's output (ReLU(fc1) is positively
  homogeneous), so 1 / s goes into up_proj's (fc1's) output rows. The attention's o_proj is left
  alone, as SmoothQuant leaves it.
* ``keep=auto``: the FFNs that write massive activations (Sun et al.'s criterion, |x| > 100 and
  > 1000 x the sequence's median |x|, on each FFN's output over the calibration batches) stay in full
  precision, with the Linears inside them.
* ``rotate=``: :mod:`quantgate.quant.rotate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.nn as nn

from ..errors import InputError
from ..massive import MassiveActivations
from ..models.families import config_of, family_of
from ..models.record import MitigationRecord, RotationRecord, SmoothingRecord, set_record
from ..models.swap import attention_modules
from .rotate import gate_readers, linear_at
from .schemes import CalibratedScheme, Scheme

Calibrate = Callable[[nn.Module], object]  # runs the calibration batches through a model

__all__ = ["mitigate", "needed", "smooth_", "smoothing_groups", "massive_ffns"]

S = TypeVar("S", bound=CalibratedScheme)


def needed(calibrate: Calibrate | None, scheme: Scheme) -> Calibrate:
    """``calibrate``, which ``scheme`` needs: ValueError when there is none."""
    if calibrate is None:
        raise InputError(f"{scheme} needs calibration batches: pass a calibrate function")
    return calibrate


def mitigate(model: nn.Module, scheme: S, calibrate: Calibrate | None, rotation: RotationRecord | None = None) -> S:
    """Apply the scheme's fixes to the float model, for every backend: SmoothQuant (``smooth=``), then
    ``keep=auto`` (returns the scheme with the kept FFNs named). What ran, after the ``rotation`` the backend
    did first (where it did), is recorded as the model's pending mitigation, which quantize moves into its
    quantization record."""
    smooth = smooth_(model, scheme.smooth, needed(calibrate, scheme)) if scheme.smooth is not None else None
    keep = kept_params = None
    if "auto" in scheme.keep:
        keep = massive_ffns(model, needed(calibrate, scheme))
        kept_params = sum(p.numel() for name in keep for p in model.get_submodule(name).parameters())
        scheme = dataclasses.replace(scheme, keep=tuple(k for k in scheme.keep if k != "auto") + tuple(keep))
    done = MitigationRecord(rotation, smooth, keep, kept_params)
    if done != MitigationRecord():
        set_record(model, mitigation=done)
    return scheme


def smoothing_groups(model: nn.Module) -> list[tuple[nn.Module, str, list[nn.Linear]]]:
    """``(maker, side, readers)`` per group: ``maker`` makes the readers' shared input, as a norm
    (``side="norm"``: 1 / s scales its weight and bias) or a Linear (``side="rows"``: its output rows);
    ``readers`` get s on their input columns. Pre-norm llama, qwen2, qwen3 and opt only."""
    family, config = family_of(model), config_of(model)
    if family.ffn_linears is None or not family.is_pre_norm(config):
        raise InputError(
            f"SmoothQuant folds 1 / s into the norm before each group of Linears, as a pre-norm "
            f"llama, qwen2, qwen3 or opt block has it; this {family.name} model "
            f"({'pre' if family.is_pre_norm(config) else 'post'}-norm) is not supported"
        )
    groups: list[tuple[nn.Module, str, list[nn.Linear]]] = []
    ffn_in, ffn_maker, ffn_out = family.ffn_linears
    for block, attn in zip(family.blocks(model), attention_modules(model), strict=True):
        qkv = [linear_at(attn, p) for p in family.attn_inputs]
        groups.append((block.get_submodule(family.attn_norm), "norm", qkv + gate_readers(getattr(attn, "gate", None))))
        groups.append((block.get_submodule(family.ffn_norm), "norm", [linear_at(block, p) for p in ffn_in]))
        groups.append((block.get_submodule(ffn_maker), "rows", [linear_at(block, ffn_out)]))
    return groups


@torch.no_grad()
def smooth_(model: nn.Module, alpha: float, calibrate: Callable[[nn.Module], object]) -> SmoothingRecord:
    """SmoothQuant ``model`` in place (module docstring); ``calibrate(model)`` runs the calibration
    batches. Returns the groups smoothed and the largest and smallest s."""
    from torchao.prototype.smoothquant.core import (  # torchao prototype: imported at first use
        RunningAbsMaxSmoothQuantObserver,
    )

    groups = smoothing_groups(model)
    observers, handles = [], []
    for _, _, readers in groups:
        obs = RunningAbsMaxSmoothQuantObserver(_column_absmax(readers), alpha)
        observers.append(obs)
        handles.append(readers[0].register_forward_pre_hook(_feeding(obs)))
    try:
        calibrate(model)
    finally:
        for h in handles:
            h.remove()
    scales = []
    for (maker, side, readers), obs in zip(groups, observers, strict=True):
        s = obs.compute_smoothing_factor().clamp_min(1e-5)
        for r in readers:
            r.weight.mul_(s.to(r.weight.dtype))
        # a norm's gain (or a Linear's rows) and its bias, where it has one (a Linear always has the attribute)
        weight, bias = cast(torch.Tensor, maker.weight), getattr(maker, "bias", None)
        if side == "norm":
            weight.div_(s.to(weight.dtype))
        else:
            weight.div_(s.to(weight.dtype)[:, None])
        if bias is not None:
            bias.div_(s.to(bias.dtype))
        scales.append(s)
    every = torch.cat(scales)
    return SmoothingRecord(groups=len(groups), max_s=float(every.max()), min_s=float(every.min()))


def _column_absmax(readers: list[nn.Linear]) -> torch.Tensor:
    """max |W[:, j]| over the readers' stacked weights, as a (1, C) float32 tensor: all the observer reads of
    the weight it is given (``torch.max(torch.abs(weight), dim=0)``), the same numbers as the float32 copy of
    every reader's weight it was given before, without one (0.6x an fp32 model's bytes held through
    calibration, 1.2x a bf16 one's)."""
    per_reader = [torch.maximum(r.weight.detach().amax(dim=0), -r.weight.detach().amin(dim=0)) for r in readers]
    return torch.stack(per_reader).amax(dim=0, keepdim=True).float()


def _feeding(observer):
    """A forward pre-hook that shows a Linear's input to ``observer`` and changes nothing."""

    def hook(module, args):
        observer(args[0].float())

    return hook


@torch.no_grad()
def massive_ffns(model: nn.Module, calibrate: Callable[[nn.Module], object]) -> list[str]:
    """Names of the FFN modules whose output holds massive activations on the calibration batches."""
    family = family_of(model)
    names = {id(m): n for n, m in model.named_modules()}
    ffns = [block.get_submodule(family.ffn) for block in family.blocks(model)]
    found = [MassiveActivations() for _ in ffns]
    handles = [
        f.register_forward_hook(lambda m, a, out, c=c: c.update(out[0] if isinstance(out, tuple) else out, None))
        for f, c in zip(ffns, found, strict=True)
    ]
    try:
        calibrate(model)
    finally:
        for h in handles:
            h.remove()
    return [names[id(f)] for f, c in zip(ffns, found, strict=True) if c.count]
