"""Where quantization hurts: per-layer SQNR of a quantized model against its float source."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..models.families import family_of

__all__ = ["quant_error", "sqnr_db"]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal energy / noise energy); inf when the noise is zero."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


@torch.no_grad()
def quant_error(fp_model: nn.Module, q_model: nn.Module, batches, *, max_batches: int | None = 4) -> dict:
    """Run both models on the same batches and report the SQNR (dB) of every block's output, of the
    logits and, for simulated schemes, of every activation quantizer (with FP8 saturation counts).
    ``worst_layers`` lists the three blocks with the lowest SQNR."""
    from .simulate import act_quantizers

    family = family_of(fp_model)
    outputs: dict[str, list] = {"fp": [], "q": []}
    hooks = []
    for key, model in (("fp", fp_model), ("q", q_model)):
        for block in family.blocks(model):
            hooks.append(block.register_forward_hook(
                lambda m, a, o, key=key: outputs[key].append((o[0] if isinstance(o, tuple) else o).detach().float())))
    quantizers = {n: m for n, m in q_model.named_modules() if m in set(act_quantizers(q_model))}
    for q in quantizers.values():
        q.track, q.signal, q.noise, q.overflow, q.values = True, 0.0, 0.0, 0, 0
    n_layers = len(family.blocks(fp_model))
    energy = [[0.0, 0.0] for _ in range(n_layers + 1)]  # blocks, then logits
    modes = (fp_model.training, q_model.training)
    fp_model.eval(), q_model.eval()
    batches_run = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            outputs["fp"].clear(), outputs["q"].clear()
            ref = fp_model(**{k: v.to(_device(fp_model)) for k, v in inputs.items()}).logits.float()
            got = q_model(**{k: v.to(_device(q_model)) for k, v in inputs.items()}).logits.float().to(ref.device)
            for layer, (a, b) in enumerate(zip(outputs["fp"], outputs["q"])):
                energy[layer][0] += float(a.double().square().sum())
                energy[layer][1] += float((a.double() - b.to(a.device).double()).square().sum())
            energy[-1][0] += float(ref.double().square().sum())
            energy[-1][1] += float((ref.double() - got.double()).square().sum())
            batches_run += 1
    finally:
        for h in hooks:
            h.remove()
        for q in quantizers.values():
            q.track = False
        fp_model.train(modes[0]), q_model.train(modes[1])
    if batches_run == 0:
        raise ValueError("quant_error got no batches")
    layers = [{"layer": i, "sqnr_db": sqnr_db(*energy[i])} for i in range(n_layers)]
    quant = [{"name": n, "sqnr_db": sqnr_db(q.signal, q.noise), "overflow": q.overflow, "values": q.values}
             for n, q in quantizers.items()]
    quant.sort(key=lambda r: r["sqnr_db"])
    return {"layers": layers, "logits_sqnr_db": sqnr_db(*energy[-1]),
            "worst_layers": sorted(layers, key=lambda r: r["sqnr_db"])[:3], "quantizers": quant,
            "overflow": sum(r["overflow"] for r in quant), "batches": batches_run}


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
