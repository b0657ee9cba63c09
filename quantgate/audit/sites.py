"""Per-site fallback: which quantized Linears to keep in 16-bit so that a scheme stays within the tolerance.

A *site* is what one kept layer of a serving engine is: a Linear a simulated scheme quantizes at
``acts=linear-inputs`` (its weight and its input quantizer), or the Linears vLLM fuses into one layer kept together
(q, k and v; gate and up: vLLM refuses a fused layer whose parts are quantized differently, "Found different
quantization schemes for the shards of model.layers.1.mlp.gate_up_proj"). :class:`Sites` holds a quantized model
beside its float source and reverts any set of sites to float (the float weight back in place, the input quantizer
off) without quantizing again; a recipe that keeps those sites is the scheme with ``keep=`` naming them, quantized
afresh where it is certified and exported.

Ranking the sites by how much each costs, four ways (:data:`RANKINGS`; the audit ranks by ``gradient``, which on
SmolLM2 holds 0.99 of the top-10 cost of the exhaustive ranking on 8x the text, at a twentieth of its time:
results/bench/site_ranking-cpu.md):

* ``revert-one``: the loss of the quantized model with that site alone reverted, below the loss with none
  reverted (one forward pass per site; the exhaustive reference, NNCF's accuracy control ranks this way);
* ``quantize-one``: the loss with that site alone quantized, above the float model's (one pass per site);
* ``output-error``: the squared error the site's quantized weight and input put on its output, float inputs
  (one pass in all);
* ``gradient``: that error weighted by the loss's gradient at the output, sum((dL/dy * (Q(y) - y))^2) (ModelOpt's
  ``auto_quantize`` score; one forward and one backward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..models.modes import eval_mode
from ..quant.schemes import SimulatedScheme, get_scheme
from ..quant.simulate import ActQuant

__all__ = ["Sites", "RANKINGS", "can_fall_back", "keep_scheme"]

Batch = Mapping[str, torch.Tensor]  # model inputs with labels


def can_fall_back(scheme: str) -> bool:
    """Whether keeping sites of ``scheme`` in 16-bit is the same as reverting them after quantizing: a simulated
    scheme with activations at the Linears' inputs and no mitigation that rewrites other weights (SmoothQuant,
    rotations, ``keep=auto``)."""
    s = get_scheme(scheme)
    return (
        isinstance(s, SimulatedScheme)
        and s.act is not None
        and s.acts == "linear-inputs"
        and s.smooth is None
        and s.rotate == "none"
        and "auto" not in s.keep
        and s.kv is None
    )


def keep_scheme(scheme: str, kept: Sequence[str]) -> str:
    """``scheme`` with the sites ``kept`` in 16-bit (``keep=`` naming each, joined by ``|``)."""
    s = get_scheme(scheme)
    names = [*s.keep, *kept]
    return str(s) if not names else f"{s}{':' if ':' not in str(s) else ','}keep={'|'.join(names)}"


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # fmt: skip


def site_of(linear: str) -> str:
    """The site a Linear belongs to: its own name, or the fused layer's (``model.layers.3.self_attn.qkv_proj``)."""
    head, _, last = linear.rpartition(".")
    return f"{head}.{FUSED[last]}" if last in FUSED else linear


class Sites:
    """The sites of ``quantized`` (a copy of ``float_model`` quantized by a simulated scheme at linear inputs), in
    the model's order; :meth:`reverted` puts any of them back to float for a block."""

    def __init__(self, quantized: nn.Module, float_model: nn.Module) -> None:
        floats = dict(float_model.named_modules())
        self.model = quantized
        self.linears = {
            n: m for n, m in quantized.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "input_quant")
        }
        self.float_weights = {n: floats[n].weight.data for n in self.linears}
        self.quant_weights = {n: m.weight.data for n, m in self.linears.items()}
        self.members: dict[str, list[str]] = {}
        for n in self.linears:
            self.members.setdefault(site_of(n), []).append(n)
        self.names = list(self.members)

    def __len__(self) -> int:
        return len(self.names)

    def linear_names(self, sites: Sequence[str]) -> list[str]:
        """The Linears of ``sites``, in order."""
        return [n for s in sites for n in self.members[s]]

    @contextmanager
    def reverted(self, sites: Sequence[str]) -> Iterator[None]:
        """The ``sites`` in float for the block: their float weights in place, their input quantizers off."""
        saved = {}
        try:
            for n in self.linear_names(sites):
                m = self.linears[n]
                saved[n] = m.weight.data
                m.weight.data = self.float_weights[n]
                _quant(m).enabled = False
            yield
        finally:
            for n, w in saved.items():
                self.linears[n].weight.data = w
                _quant(self.linears[n]).enabled = True

    # --- ranking --------------------------------------------------------------------------------

    def rank(self, method: str, batches: Sequence[Batch]) -> dict[str, float]:
        """Each site's cost by ``method`` (:data:`RANKINGS`) on ``batches`` (with labels): larger costs more."""
        return RANKINGS[method](self, batches)

    def loss(self, batches: Sequence[Batch]) -> float:
        """The quantized model's mean loss (nats per predicted token) on ``batches``, as its sites are now."""
        return _loss(self.model, batches)


def _quant(m: nn.Module) -> ActQuant:
    """A site's input quantizer."""
    q = m.input_quant
    assert isinstance(q, ActQuant)
    return q


@torch.no_grad()
def _loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    total, count = 0.0, 0
    with eval_mode(model):
        for b in batches:
            out = model(**b)
            n = int((b["labels"] != -100).sum())
            total, count = total + float(out.loss.detach()) * n, count + n
    return total / count


def _revert_one(sites: Sites, batches: Sequence[Batch]) -> dict[str, float]:
    base = sites.loss(batches)
    costs = {}
    for n in sites.names:
        with sites.reverted([n]):
            costs[n] = base - sites.loss(batches)
    return costs


def _quantize_one(sites: Sites, batches: Sequence[Batch]) -> dict[str, float]:
    costs = {}
    with sites.reverted(sites.names):
        base = sites.loss(batches)
    for n in sites.names:
        others = [m for m in sites.names if m != n]
        with sites.reverted(others):
            costs[n] = sites.loss(batches) - base
    return costs


def _site_errors(
    sites: Sites, batches: Sequence[Batch], weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
) -> dict[str, float]:
    """Per site, over the float model's forward passes: sum(err^2) of err = Q-site(y) - y (``weigh`` None), or
    sum((dL/dy * err)^2) (the gradient's score: ``weigh(err, grad)``)."""
    costs = dict.fromkeys(sites.names, 0.0)

    def hook(name: str):
        m, weight, site = sites.linears[name], sites.quant_weights[name], site_of(name)

        def run(module, args, output):
            with torch.no_grad():
                _quant(m).enabled = True
                try:
                    err = F.linear(_quant(m)(args[0]), weight, m.bias) - output
                finally:
                    _quant(m).enabled = False
            if weigh is None:
                costs[site] += float(err.float().square().sum())
            else:
                output.register_hook(lambda g: costs.__setitem__(site, costs[site] + float(weigh(err, g))))

        return run

    with sites.reverted(sites.names):  # the float model runs; each hook quantizes its own site on the side
        handles = [m.register_forward_hook(hook(n)) for n, m in sites.linears.items()]
        try:
            with eval_mode(sites.model):
                for b in batches:
                    if weigh is None:
                        with torch.no_grad():
                            sites.model(**b)
                    else:
                        with torch.enable_grad():
                            sites.model(**b).loss.backward()
        finally:
            for h in handles:
                h.remove()
            sites.model.zero_grad(set_to_none=True)
    return costs


def _gradient(sites: Sites, batches: Sequence[Batch]) -> dict[str, float]:
    params = list(sites.model.parameters())
    grads = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    embeddings = cast(nn.Embedding, cast(PreTrainedModel, sites.model).get_input_embeddings())
    embeddings.weight.requires_grad_(True)  # a gradient must flow back through every block
    try:
        return _site_errors(sites, batches, lambda err, g: (g.float() * err.float()).square().sum())
    finally:
        for p, was in zip(params, grads, strict=True):
            p.requires_grad_(was)


RANKINGS: dict[str, Callable[[Sites, Sequence[Batch]], dict[str, float]]] = {
    "revert-one": _revert_one,
    "quantize-one": _quantize_one,
    "output-error": lambda sites, batches: _site_errors(sites, batches, None),
    "gradient": _gradient,
}
