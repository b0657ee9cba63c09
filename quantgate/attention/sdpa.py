"""gated_sdpa: scaled dot-product attention with an output gate, clipped softmax, learned sinks,
and the attention mass on the first keys (the attention sink), on interchangeable backends.

Shapes: q (B, Hq, N, D); k (B, Hkv, M, D); v (B, Hkv, M, Dv) with Hq a multiple of Hkv (GQA);
gate broadcastable to the output (B, Hq, N, Dv); attn_mask boolean (True = attend) or additive,
broadcastable to (B, Hq, N, M); sinks (Hq,) logits. ``is_causal`` aligns the mask top-left as
torch's SDPA does (query i sees keys 0..i).

Backends:
* ``eager``: the reference. Materialises the (B, Hq, N, M) probabilities; supports everything.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (flash / efficient / cuDNN kernels
  on CUDA, the flash kernel on CPU) times the gate. Sink mass and learned sinks use the
  log-sum-exp that torch's flash kernels return, so they need O(N) memory, never the N x M matrix.
  Clipped softmax and learned sinks under autograd fall back to ``eager``.
* ``triton``: the fused kernel of :mod:`quantgate.attention.triton_sdpa` (CUDA; the ``triton`` extra):
  the gate multiplies the output in the kernel's epilogue, learned sinks are one extra logit per row,
  sink mass comes from the same pass. Causal and key-padding masks (boolean masks that are exactly
  causal & key padding are recognised); clipped softmax, dropout and other masks fall back to
  ``sdpa`` with a warning.
* ``auto``: the fastest backend that supports the call: ``triton`` on CUDA when it is installed and
  the call is supported, else ``sdpa`` unless that would fall back to ``eager``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from quantgate.errors import InputError

__all__ = ["gated_sdpa", "BACKENDS"]

BACKENDS = ("auto", "eager", "sdpa", "triton")
log = logging.getLogger("quantgate")


def gated_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    clip: tuple[float, float] | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    sink_tokens: int = 0,
    fake_quant: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``gate * softmax(q k^T * scale + mask) v`` with the options in the module docstring.

    clip: (gamma, zeta) for clipped softmax. sink_tokens: when k > 0, also return the attention
    probability on the first k keys, shape (B, Hq, N). fake_quant: optional mapping of "q", "k", "v",
    "scores" (softmax input) and "probs" (softmax output) to functions applied to those tensors
    (simulated quantization; quantizing scores or probs runs on the eager backend).
    Returns out (B, Hq, N, Dv), or (out, mass).
    """
    _check_shapes(q, k, v, sinks)
    if backend not in BACKENDS:
        raise InputError(f"unknown gated_sdpa backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend in ("auto", "triton") and fake_quant is None and (backend == "triton" or q.is_cuda):
        out = _triton(
            q,
            k,
            v,
            gate,
            attn_mask,
            is_causal,
            scale,
            clip,
            sinks,
            dropout_p,
            sink_tokens,
            explicit=backend == "triton",
        )
        if out is not None:
            return out
    if fake_quant is not None:
        q, k, v = (fake_quant[n](t) if n in fake_quant else t for n, t in (("q", q), ("k", k), ("v", v)))
    if (fake_quant is not None and ("scores" in fake_quant or "probs" in fake_quant)) or (
        backend != "eager" and _needs_eager(q, k, v, clip, sinks)
    ):
        backend = "eager"
    args = (q, k, v, gate, attn_mask, is_causal, scale, clip, sinks, dropout_p, sink_tokens)
    out, mass = _eager(*args, fake_quant=fake_quant) if backend == "eager" else _sdpa(*args)
    return (out, mass) if sink_tokens > 0 else out


def _check_shapes(q, k, v, sinks):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InputError(
            f"gated_sdpa expects 4-d (B, H, N, D) tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise InputError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}, {v.shape[1]})"
        )
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise InputError(f"sinks must have shape ({q.shape[1]},), got {tuple(sinks.shape)}")


def _needs_eager(q, k, v, clip, sinks) -> bool:
    """What the sdpa backend cannot express: clipped softmax, sinks that need gradients."""
    if clip is not None:
        return True
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
    return sinks is not None and grads


@functools.cache
def _triton_kernels():
    """The Triton kernel module, or None when triton is not installed."""
    try:
        from . import triton_sdpa  # triton: imported at first use (optional, CUDA machines)
    except ImportError:
        return None
    return triton_sdpa


def _triton(q, k, v, gate, attn_mask, is_causal, scale, clip, sinks, dropout_p, sink_tokens, explicit):
    """Run the fused kernel; None when the call needs another backend (a warning if it was asked for)."""
    kernels = _triton_kernels()
    if kernels is None:
        if explicit:
            raise InputError("backend 'triton' needs the triton package: pip install -e '.[triton]' (CUDA machines)")
        return None
    reason = kernels.supports(q, k, v)
    if reason and explicit:
        raise InputError(reason)
    masks = _key_padding(attn_mask, is_causal, q.shape[2], k.shape[2]) if not reason else None
    if not reason:
        reason = (
            "clipped softmax"
            if clip is not None
            else "dropout"
            if dropout_p > 0.0
            else "a mask other than causal and key padding"
            if masks is None
            else None
        )
    if reason:
        if explicit:
            _warn_fallback(reason)
        return None
    assert masks is not None  # no reason to fall back: the masks were recognised
    key_padding, causal = masks
    out, _, mass = kernels.flash_gated_sdpa(
        q, k, v, gate, key_padding=key_padding, is_causal=causal, scale=scale, sinks=sinks, sink_tokens=sink_tokens
    )
    return (out, mass) if sink_tokens > 0 else out


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("gated_sdpa backend 'triton' does not run %s: falling back to 'sdpa' for those calls", reason)


def _key_padding(attn_mask, is_causal, n, m):
    """(key_padding (B, M) bool or None, causal) equivalent to the mask, or None when there is none.

    Recognises boolean masks that broadcast over heads and queries (key padding) and the (B, 1, N, M)
    masks transformers builds for padded causal batches (exactly causal & key padding).
    """
    if attn_mask is None:
        return None, is_causal
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1:
        return None
    if attn_mask.shape[2] == 1:
        return attn_mask[:, 0, 0, :], is_causal
    kp = attn_mask[:, 0, -1, :]  # the last query row sees every valid key in both layouts
    if torch.equal(attn_mask[:, 0], kp[:, None, :].expand(-1, n, -1)):
        return kp, is_causal
    if torch.equal(attn_mask[:, 0], kp[:, None, :] & torch.ones(n, m, dtype=torch.bool, device=kp.device).tril()):
        return kp, True
    return None


def _valid_mask(attn_mask, is_causal, n, m, device) -> torch.Tensor | None:
    """Boolean mask of allowed (query, key) pairs, or None when everything is allowed."""
    valid = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        valid = attn_mask
    if is_causal:
        causal = torch.ones(n, m, dtype=torch.bool, device=device).tril()
        valid = causal if valid is None else valid & causal
    return valid


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _clipped(p: torch.Tensor, clip) -> torch.Tensor:
    gamma, zeta = clip
    return ((zeta - gamma) * p + gamma).clamp(0.0, 1.0)


def _eager(q, k, v, gate, attn_mask, is_causal, scale, clip, sinks, dropout_p, sink_tokens, fake_quant=None):
    _b, h, n, d = q.shape
    m = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    scores = (q @ k.transpose(-1, -2)).float().mul_(scale)  # a fresh tensor: changed in place from here on
    if fake_quant is not None and "scores" in fake_quant:
        scores = fake_quant["scores"](scores)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.float()
    valid = _valid_mask(attn_mask, is_causal, n, m, q.device)
    if valid is not None:
        scores = scores.masked_fill_(~valid, float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, h, 1, 1).expand(scores.shape[0], h, n, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    additive = attn_mask is not None and attn_mask.dtype != torch.bool  # its -inf may mask a whole row
    if additive or (valid is not None and not bool(valid.any(-1).all())):
        # fully masked rows attend to nothing; in place only when autograd does not keep softmax's output
        probs = probs.nan_to_num(0.0) if probs.requires_grad else probs.nan_to_num_(0.0)
    if clip is not None:
        probs = _clipped(probs, clip)
    if sinks is not None:
        probs = probs[..., :m]
    if fake_quant is not None and "probs" in fake_quant:
        probs = fake_quant["probs"](probs)
    mass = probs[..., :sink_tokens].sum(-1) if sink_tokens > 0 else None
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = probs.to(v.dtype) @ v
    return (out if gate is None else out * gate), mass


def _sdpa(q, k, v, gate, attn_mask, is_causal, scale, clip, sinks, dropout_p, sink_tokens):
    h = q.shape[1]
    if sinks is None and sink_tokens == 0:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=k.shape[1] != h,
        )
        mass = None
    else:
        out, lse = _sdpa_with_lse(q, k, v, attn_mask, is_causal, scale, dropout_p)
        if sinks is not None:
            sink = sinks.float().view(1, h, 1)
            out = out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
            lse = torch.logaddexp(lse, sink.expand_as(lse))
        mass = _first_key_mass(q, k, lse, attn_mask, is_causal, scale, sink_tokens) if sink_tokens else None
    return (out if gate is None else out * gate), mass


def _sdpa_with_lse(q, k, v, attn_mask, is_causal, scale, dropout_p):
    """SDPA output and its row log-sum-exp (B, Hq, N), float32, in O(N) memory.

    The output keeps autograd through torch's public SDPA; the log-sum-exp is a statistic (no
    grad). On CPU without autograd one call of torch's flash kernel returns both.
    """
    h = q.shape[1]
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type == "cpu" and not grads and dropout_p == 0.0 and q.shape[-1] == v.shape[-1]:
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        elif mask is not None:
            mask = mask.to(q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        # the kernel reports 0 for rows with no key to attend to; make it -inf (zero probability)
        return out, lse.float().masked_fill(_all_masked(attn_mask, is_causal, q), float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != h
    )
    with torch.no_grad():
        return out, _chunked_lse(q, _repeat_kv(k, h), attn_mask, is_causal, scale)


def _chunked_lse(q, k, attn_mask, is_causal, scale, chunk: int = 256) -> torch.Tensor:
    """Row log-sum-exp of the masked scores over chunks of queries: O(chunk * M) memory."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for start in range(0, q.shape[2], chunk):
        s = (q[:, :, start : start + chunk] @ k.transpose(-1, -2)).float() * scale
        rows.append(torch.logsumexp(_mask_scores(s, attn_mask, is_causal, start), dim=-1))
    return torch.cat(rows, dim=-1)


def _all_masked(attn_mask, is_causal, q) -> torch.Tensor:
    """(B|1, H|1, N) True where a query row has no key to attend to (boolean masks only)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return torch.zeros(1, 1, q.shape[2], dtype=torch.bool, device=q.device)
    m = attn_mask.shape[-1]
    valid = _valid_mask(attn_mask, is_causal, q.shape[2], m, q.device)
    assert valid is not None  # a boolean attn_mask
    return ~valid.any(-1)


def _mask_scores(s, attn_mask, is_causal, row0: int):
    """Apply the mask rows row0 .. row0 + s.shape[-2] to scores s (B, H, rows, M)."""
    rows, m = s.shape[-2], s.shape[-1]
    if attn_mask is not None:
        part = attn_mask[..., row0 : row0 + rows, :] if attn_mask.shape[-2] > 1 else attn_mask
        s = s.masked_fill(~part, float("-inf")) if part.dtype == torch.bool else s + part.float()
    if is_causal:
        qi = torch.arange(row0, row0 + rows, device=s.device).view(-1, 1)
        s = s.masked_fill(torch.arange(m, device=s.device).view(1, -1) > qi, float("-inf"))
    return s


@torch.no_grad()
def _first_key_mass(q, k, lse, attn_mask, is_causal, scale, sink_tokens):
    """Attention probability on the first ``sink_tokens`` keys from the row log-sum-exp: O(N * k)."""
    h, d = q.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    kf = _repeat_kv(k[:, :, :sink_tokens], h)
    s = (q @ kf.transpose(-1, -2)).float() * scale
    mask = attn_mask[..., :sink_tokens] if attn_mask is not None else None
    s = _mask_scores(s, mask, is_causal, 0)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0).sum(-1)
