"""QuaRot-style rotation: the same float function, with the residual stream in a randomized-Hadamard basis.

An orthogonal Q (d_model x d_model, random signs times a normalized Hadamard matrix) spreads a few
massive channels over all channels, so per-tensor or per-token quantizers see a flat range. With
x the residual stream as a row vector and x' = x Q:

* pre-norm gains (and LayerNorm biases) are folded into the Linears that read the norm: q/k/v, the
  attention gate's input projection, gate/up (fc1), the LM head; the norm becomes :class:`UnitRMSNorm`
  (no parameters, same eps, same module path), which commutes with Q: rms(x Q) = rms(x);
* readers and embeddings (token table, OPT's position table, LM head; shape (*, d_model)): W <- W Q;
* writers of the residual (o_proj / out_proj, down_proj / fc2; shape (d_model, *)): W <- Q^T W, b <- Q^T b;
* ``online``: the FFN output Linear (in_features d_ff) gets a normalized Hadamard M (d_ff x d_ff) at run
  time, x -> x M in a forward pre-hook (:class:`OnlineHadamard`, O(d_ff log d_ff)), and W <- W M,
  so (x M)(W M)^T = x W^T.

OPT's LayerNorm subtracts the mean over channels, which a rotation does not commute with. As in
SliceGPT, every writer of the residual (both embedding tables, the rows and biases of out_proj and
fc2) is centred first, so the stream is mean-free and LayerNorm(x) = RMSNorm(x) * g + b exactly;
g and b then fold like an RMSNorm gain. Tied embeddings are untied: the table is rotated as the
stream's input, the head as a reader with the final norm's gain folded in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from quantgate.errors import InputError, MissingDependency

from ..attention.gates import Gate
from ..models.families import config_of, family_of, find_submodule
from ..models.record import RotationRecord, record_of, set_record

__all__ = [
    "rotate_",
    "check_rotatable",
    "gate_readers",
    "linear_at",
    "UnitRMSNorm",
    "OnlineHadamard",
]

_HAD_BASES = (1, 12, 20, 28, 36, 40, 44, 52, 60, 108, 140, 156, 172)  # torchao's get_hadK: sizes K * 2^m


class UnitRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32: a norm whose gain was folded into its readers."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def _had() -> ModuleType:
    """torchao's Hadamard utilities (imported on first use: torchao is slow to import)."""
    try:
        from torchao.prototype.spinquant import hadamard_utils  # torchao prototype: imported at first use
    except ImportError as e:
        raise MissingDependency(f"rotation needs torchao (pip install 'torchao>=0.18,<0.19'): {e}") from None
    return hadamard_utils


@dataclass(frozen=True, eq=False)  # a hook is itself: no comparison of its tensor
class OnlineHadamard:
    """Forward pre-hook of an online-rotated Linear: its input x -> x M, M torchao's normalized Hadamard matrix of
    the input's size n = K * 2^m (``hadK``: its K-point block, None for K = 1). In float32 by torchao's butterfly
    (O(n log n)); in bfloat16 / float16, whose butterfly rounds at each of its log n stages, as one matmul by the
    exact +-1 matrix, then 1 / sqrt(n) in float32: closer to x M there (tests/test_rotate.py) and, on this CPU's
    bf16 matrix units, 5x faster (1.4 ms against 6.9 ms for 512 x 1536 values)."""

    hadK: torch.Tensor | None
    K: int

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if x.dtype == torch.float32:
            return (_had().matmul_hadU(x.contiguous(), self.hadK, self.K), *args[1:])
        n = x.shape[-1]
        signs = _hadamard_signs(n, x.dtype, x.device)
        return ((nn.functional.linear(x, signs).float() * (1 / math.sqrt(n))).to(x.dtype), *args[1:])


@functools.cache
def _hadamard_signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """sqrt(n) M^T for torchao's normalized Hadamard M of size n: an exact +-1 matrix in ``dtype``, so that
    ``linear(x, it) / sqrt(n) = x M``."""
    hadK, K = _hadamard(n, "d_ff, for the online transform")
    m = _had().matmul_hadU_slow(torch.eye(n, dtype=torch.float64), hadK, K)  # row i: e_i M
    return (m.T * math.sqrt(n)).round().to(dtype=dtype, device=device).contiguous()


def _hadamard(n: int, what: str) -> tuple[torch.Tensor, int]:
    """torchao's (hadK, K) for a normalized Hadamard transform of size n; ValueError where it has none."""
    try:
        hadK, K = _had().get_hadK(n)
    except AssertionError:  # get_hadK asserts on sizes it cannot build
        K = None
    if K is None or n % K or not _had().is_pow2(n // K):
        raise InputError(
            f"no Hadamard matrix of size {n} ({what}): torchao's hadamard_utils builds sizes "
            f"K * 2^m for K in {', '.join(map(str, _HAD_BASES))}"
        )
    return hadK, K


def gate_readers(gate: Gate | None) -> list[nn.Linear]:
    """The Linears of an attention gate that read the attention input x (the attention norm's output), or
    ValueError naming the gate where x is read otherwise (rotation and smoothing both rescale x's channels)."""
    if gate is None:
        return []
    problem = gate.x_reading_problem()
    if problem is not None:
        raise InputError(f"cannot rotate or smooth attention gate {gate.spec}: {problem}")
    readers = [getattr(gate, n) for n in gate.x_readers or () if hasattr(gate, n)]
    # low rank: the down projection
    return [cast(nn.Linear, r[0]) if isinstance(r, nn.Sequential) else r for r in readers]


def check_rotatable(model: nn.Module, *, online: bool = True) -> None:
    """Raise ValueError, saying why, unless :func:`rotate_` can rotate ``model`` exactly (with ``online``: its
    FFN width too); it changes nothing."""
    family = family_of(model)
    hf, config = cast(PreTrainedModel, model), config_of(model)
    if family.no_rotation:
        raise InputError(f"cannot rotate a {family.name} model: {family.no_rotation}")
    if family.ffn_linears is None:
        raise InputError(f"cannot rotate a {family.name} model: its FFN layout is not known (Family.ffn_linears)")
    record = record_of(config)
    if record.rotation is not None:
        raise InputError(f"this model is already rotated ({record.rotation.to_json()}); rotate a fresh float model")
    if record.quantization is not None:
        raise InputError("this model is already quantized; rotate the float model, then quantize it")
    if not family.is_pre_norm(config):
        raise InputError(
            f"cannot rotate a post-LN {family.name} model ({family.pre_norm}=False): its norms read "
            f"the residual sums, so no norm sits between the stream and its readers"
        )
    base = hf.base_model
    for path in (p for p in family.outer_outputs if p != family.final_norm):  # OPT's project_in/project_out
        if find_submodule(base, path) is not None:
            raise InputError(f"cannot rotate a {family.name} model with {path} (project_in/project_out): not handled")
    if family.final_norm_of(model) is None:
        raise InputError(
            f"cannot rotate a {family.name} model without a final norm: the head would read the stream directly"
        )
    if hf.get_output_embeddings() is None:
        raise InputError(
            f"cannot rotate a {type(model).__name__}: it has no LM head to rotate, so its outputs "
            f"would stay in the rotated basis"
        )
    blocks = family.blocks(model)
    for block in blocks:
        gate = getattr(block.get_submodule(family.attention), "gate", None)
        if gate is not None and gate.unrotatable:
            raise InputError(f"cannot rotate attention gate {gate.spec}: {gate.unrotatable}")
        gate_readers(gate)
    _hadamard(config.hidden_size, "d_model")
    if online:
        for n in {linear_at(block, family.ffn_linears[2]).in_features for block in blocks}:
            _hadamard(n, "d_ff, for the online transform")


def linear_at(owner: nn.Module, path: str) -> nn.Linear:
    """The nn.Linear at ``owner.path`` (get_submodule is typed for any Module)."""
    return cast(nn.Linear, owner.get_submodule(path))


def _right(w: torch.Tensor, m: torch.Tensor) -> None:
    """w <- w m, in float64: m acts on the last dim (a reader's in-features, an embedding's channels)."""
    w.copy_(w.double() @ m.to(w.device))


def _rotate_writer(linear: nn.Linear, Q: torch.Tensor) -> None:
    """Output rows W <- Q^T W, b <- Q^T b."""
    _right(linear.weight.T, Q)
    if linear.bias is not None:
        _right(linear.bias, Q)


def _centre(w: torch.Tensor, dim: int) -> None:
    w.copy_(w.double() - w.double().mean(dim, keepdim=True))


def _fold_norm(owner: nn.Module, path: str, readers: list[nn.Linear]) -> int:
    """Fold the norm at ``owner.path`` into ``readers``, replace it by a UnitRMSNorm; return parameters added."""
    norm = owner.get_submodule(path)
    gain: torch.Tensor | None
    shift: torch.Tensor | None
    if isinstance(norm, nn.LayerNorm):
        gain, shift, eps = norm.weight, norm.bias, norm.eps
    else:  # the family's RMSNorm (LlamaRMSNorm and its kind): a gain, no bias
        gain, shift, eps = cast(torch.Tensor, norm.weight), None, cast(float, norm.variance_epsilon)
    added = 0
    for linear in readers:
        w = linear.weight.double()
        if shift is not None and shift.any():  # W (n g + b) + c = (W g) n + (c + W b)
            if linear.bias is None:
                linear.bias = nn.Parameter(torch.zeros_like(linear.weight[:, 0]))
                added += linear.out_features
            linear.bias.copy_(linear.bias.double() + w @ shift.double())
        if gain is not None:
            linear.weight.copy_(w * gain.double())
    owner.set_submodule(path, UnitRMSNorm(eps))
    return added


@torch.no_grad()
def rotate_(model: nn.Module, *, online: bool = True, seed: int = 0) -> RotationRecord:
    """Rotate ``model`` (llama, qwen2, qwen3, pre-LN opt; gated or not) in place; its float outputs are unchanged.

    ``seed`` draws Q's random signs; ``online`` adds the Hadamard transform at each FFN output projection.
    Returns, and records as the model record's ``rotation``, a :class:`~quantgate.models.record.RotationRecord`:
    ``extra_params`` are the biases added where a LayerNorm bias folds into a bias-free reader (0 for RMSNorm
    models; OPT: the LM head's vocab_size, and low-rank gates' down projections); ``extra_ops_per_token`` the
    additions/subtractions of the online transforms per token, layers * d_ff * (log2(d_ff / K) + K - 1) for
    d_ff = K * 2^m: log2(d_ff / K) butterfly stages, then a K-point +-1 Hadamard (K - 1 per output) per group of
    K; 0 without online.
    """
    check_rotatable(model, online=online)
    hf, config = cast(PreTrainedModel, model), config_of(model)
    family = family_of(model)
    base, blocks = hf.base_model, family.blocks(model)
    assert family.ffn_linears is not None  # check_rotatable refused it otherwise
    ffn_in_paths, _, ffn_out_path = family.ffn_linears
    d = config.hidden_size
    assert family.final_norm is not None  # check_rotatable refused a model without one
    centre = isinstance(family.final_norm_of(model), nn.LayerNorm)  # see the module docstring
    embeds = [cast(nn.Embedding, hf.get_input_embeddings())]
    if family.position_table is not None:
        embeds.append(cast(nn.Embedding, base.get_submodule(family.position_table)))
    head: nn.Linear = hf.get_output_embeddings()
    if head.weight is embeds[0].weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
        config.tie_word_embeddings = False
    Q = _had().random_hadamard_matrix(d, "cpu", seed).double()

    for table in embeds:
        if centre:
            _centre(table.weight, -1)
        _right(table.weight, Q)
    added = _fold_norm(base, family.final_norm, [head])
    _right(head.weight, Q)
    n = ops = 0
    for block in blocks:
        attn = block.get_submodule(family.attention)
        attn_in = [linear_at(attn, name) for name in family.attn_inputs]
        attn_in += gate_readers(getattr(attn, "gate", None))
        ffn_in = [linear_at(block, p) for p in ffn_in_paths]
        writers = [linear_at(block, family.o_proj), linear_at(block, ffn_out_path)]
        added += _fold_norm(block, family.attn_norm, attn_in) + _fold_norm(block, family.ffn_norm, ffn_in)
        for linear in attn_in + ffn_in:
            _right(linear.weight, Q)
        for linear in writers:
            if centre:
                _centre(linear.weight, 0)
                if linear.bias is not None:
                    _centre(linear.bias, 0)
            _rotate_writer(linear, Q)
        if online:
            down = writers[1]
            n = down.in_features
            hadK, K = _hadamard(n, "d_ff")
            down.weight.copy_(_had().matmul_hadU_slow(down.weight.double(), hadK, K))  # each row w -> w M, float64
            down.register_forward_pre_hook(OnlineHadamard(hadK, K))
            ops += n * (int(math.log2(n // K)) + K - 1)

    rotation = RotationRecord(
        kind="hadamard",
        online=online,
        seed=seed,
        d_model=d,
        d_ff=n if online else None,
        extra_params=added,
        extra_ops_per_token=ops,
    )
    set_record(config, rotation=rotation)
    return rotation
