"""Fused gated flash attention in Triton: ``gate * softmax(q k^T * scale [+ sink]) v`` in one pass.

The forward kernel is flash attention (online softmax over K/V tiles, fp32 accumulators) whose
epilogue multiplies the output tile by the gate tile, so the ungated output is never written and
re-read. In the same pass it returns the row log-sum-exp and, on request, the probability mass on
the first ``sink_tokens`` keys; a learned sink is one extra logit per row in the online softmax.
The backward recomputes the probabilities from the log-sum-exp (two kernels: dK/dV per key tile,
dQ per query tile); the gate's gradient is ``dO * O_ungated``.

Shapes: q (B, Hq, N, D); k (B, Hkv, M, D); v (B, Hkv, M, Dv), Hq a multiple of Hkv; gate already
activated (sigmoid applied by the caller), broadcastable to (B, Hq, N, Dv); key_padding (B, M) bool
(True = attend); sinks (Hq,) logits. Causal is top-left aligned (query i sees keys 0..i). Head dims
up to 256 (any size; padded to a power of two in registers); fp16, bf16 (fp32 accumulation) and fp32.

Import this module only where Triton is installed; set TRITON_INTERPRET=1 before importing it to run
the kernels on a CPU (tests, dry runs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantgate.errors import InputError

__all__ = ["flash_gated_sdpa", "supports", "INTERPRET", "MAX_HEAD_DIM"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_HEAD_DIM = 256
# log2(e), from natural-log to log2 units (the kernels use exp2/log2). A module global that a @triton.jit
# kernel reads must be a constexpr, compiled or interpreted; the launchers take its float, LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the kernel can run these tensors, else the reason it cannot."""
    if q.device.type != "cuda" and not INTERPRET:
        return "the triton backend needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on a CPU)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the triton backend takes fp16, bf16 or fp32 q/k/v of one dtype, got {q.dtype}/{k.dtype}/{v.dtype}"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"the triton backend takes head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}/{v.shape[-1]}"
    return None


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _program(H, GROUP):
    """(batch * head, batch, query head, key/value head) of this program; axis 1 of the grid is B * Hq."""
    bh = tl.program_id(1)
    h = bh % H
    return bh, bh // H, h, h // GROUP


@triton.jit
def _tile(base, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    """A (rows, cols) tile at base, zero outside n_r rows and n_c columns."""
    return tl.load(
        base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        mask=(offs_r < n_r)[:, None] & (offs_c < n_c)[None, :],
        other=0.0,
    )


@triton.jit
def _scores(
    q,
    k_base,
    offs_m,
    offs_n,
    offs_d,
    skn,
    skd,
    D,
    b,
    kp_ptr,
    stride_kpb,
    N,
    M,
    scale_log2,
    CAUSAL: tl.constexpr,
    HAS_KP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of masked scores in log2 units, -inf where masked."""
    k = _tile(k_base, offs_n, offs_d, skn, skd, M, D)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    valid = (offs_n < M)[None, :] & (offs_m < N)[:, None]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if HAS_KP:
        kp = tl.load(kp_ptr + b * stride_kpb + offs_n, mask=offs_n < M, other=0)
        valid = valid & (kp != 0)[None, :]
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _fwd(
    Q,
    K,
    V,
    G,
    Out,
    OU,
    LSE,
    MASS,
    KP,
    SINK,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sgb,
    sgh,
    sgn,
    sgd,
    sob,
    soh,
    son,
    sod,
    skpb,
    H,
    GROUP,
    N,
    M,
    scale_log2,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KP: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_SINK: tl.constexpr,
    WRITE_OU: tl.constexpr,
    SINK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh, b, h, hk = _program(H, GROUP)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if HAS_SINK:  # the sink is a key with logit `sink` and a zero value: it only adds to the normaliser
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + h).to(tl.float32) * LOG2E
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    mass = tl.zeros([BLOCK_M], dtype=tl.float32)
    hi = tl.minimum(M, (start_m + 1) * BLOCK_M) if CAUSAL else M
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        s = _scores(
            q, k_base, offs_m, offs_n, offs_d, skn, skd, D, b, KP, skpb, N, M, scale_log2, CAUSAL, HAS_KP, PRECISION
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend to yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SINK_TOKENS > 0:
            mass = mass * alpha + tl.sum(tl.where((offs_n < SINK_TOKENS)[None, :], p, 0.0), 1)
        v = _tile(v_base, offs_n, offs_dv, svn, svd, M, DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    row = offs_m < N
    o_offs = b * sob + h * soh + offs_m[:, None] * son + offs_dv[None, :] * sod
    o_mask = row[:, None] & (offs_dv < DV)[None, :]
    if WRITE_OU:
        tl.store(OU + o_offs, out.to(OU.dtype.element_ty), mask=o_mask)
    if HAS_GATE:
        g = tl.load(G + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_dv[None, :] * sgd, mask=o_mask, other=0.0)
        out = out * g.to(tl.float32)
    tl.store(Out + o_offs, out.to(Out.dtype.element_ty), mask=o_mask)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + bh * N + offs_m, lse, mask=row)
    if SINK_TOKENS > 0:
        tl.store(MASS + bh * N + offs_m, mass / l_safe, mask=row)


@triton.jit
def _probs(s, lse):
    """Probabilities from log2-unit scores and the natural log-sum-exp; rows with lse=-inf get 0."""
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return tl.exp2(s - lse2[:, None])


@triton.jit
def _bwd_dkdv(
    Q,
    K,
    V,
    DOU,
    LSE,
    DELTA,
    DK,
    DV_,
    KP,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    skpb,
    H,
    GROUP,
    N,
    M,
    scale_log2,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dK, dV for one key tile and one query head (summed over the GQA group by the caller)."""
    start_n = tl.program_id(0)
    bh, b, h, hk = _program(H, GROUP)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + b * skb + hk * skh
    v = _tile(V + b * svb + hk * svh, offs_n, offs_dv, svn, svd, M, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + offs_m0
        row = offs_m < N
        q = _tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D)
        s = _scores(
            q, k_base, offs_m, offs_n, offs_d, skn, skd, D, b, KP, skpb, N, M, scale_log2, CAUSAL, HAS_KP, PRECISION
        )
        p = _probs(s, tl.load(LSE + bh * N + offs_m, mask=row, other=float("-inf")))
        do = _tile(DOU + b * sdb + h * sdh, offs_m, offs_dv, sdn, sdd, N, DV)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - tl.load(DELTA + bh * N + offs_m, mask=row, other=0.0)[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out_offs = bh * M * BLOCK_D + offs_n[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(DK + out_offs, dk * scale, mask=(offs_n < M)[:, None])
    out_offs = bh * M * BLOCK_DV + offs_n[:, None] * BLOCK_DV + offs_dv[None, :]
    tl.store(DV_ + out_offs, dv, mask=(offs_n < M)[:, None])


@triton.jit
def _bwd_dq(
    Q,
    K,
    V,
    DOU,
    LSE,
    DELTA,
    DQ,
    KP,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    skpb,
    H,
    GROUP,
    N,
    M,
    scale_log2,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ for one query tile."""
    start_m = tl.program_id(0)
    bh, b, h, hk = _program(H, GROUP)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = offs_m < N
    q = _tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D)
    do = _tile(DOU + b * sdb + h * sdh, offs_m, offs_dv, sdn, sdd, N, DV)
    lse = tl.load(LSE + bh * N + offs_m, mask=row, other=float("-inf"))
    delta = tl.load(DELTA + bh * N + offs_m, mask=row, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(M, (start_m + 1) * BLOCK_M) if CAUSAL else M
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        s = _scores(
            q, k_base, offs_m, offs_n, offs_d, skn, skd, D, b, KP, skpb, N, M, scale_log2, CAUSAL, HAS_KP, PRECISION
        )
        p = _probs(s, lse)
        v = _tile(v_base, offs_n, offs_dv, svn, svd, M, DV)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        k = _tile(k_base, offs_n, offs_d, skn, skd, M, D)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + bh * N * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :], dq * scale, mask=row[:, None])


# -------------------------------------------------------------------------------------- launchers


def _blocks(d: int, dv: int, backward: bool) -> dict:
    """Tile sizes and launch settings. The interpreter runs one program at a time: small tiles."""
    if INTERPRET:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    wide = max(d, dv) > 64
    if backward:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8 if wide else 4, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 64 if wide else 128, "num_warps": 8 if wide else 4, "num_stages": 3}


def _common(q, k, v, causal, kp, scale):
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    meta = {
        "D": d,
        "DV": dv,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK_DV": max(16, triton.next_power_of_2(dv)),
        "CAUSAL": causal,
        "HAS_KP": kp is not None,
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    kp_arg = kp if kp is not None else q  # any pointer; never read when HAS_KP is False
    return (b, h, n, m, d, dv), meta, kp_arg, (kp.stride(0) if kp is not None else 0), scale * LOG2E.value


def _forward(q, k, v, gate, sinks, kp, causal, scale, sink_tokens, write_ungated):
    (b, h, n, m, d, dv), meta, kp_arg, skpb, scale_log2 = _common(q, k, v, causal, kp, scale)
    out = torch.empty(b, h, n, dv, device=q.device, dtype=q.dtype)
    out_u = torch.empty_like(out) if write_ungated else out
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    mass = torch.empty(b, h, n, device=q.device, dtype=torch.float32) if sink_tokens else lse
    g = gate.expand(b, h, n, dv) if gate is not None else out
    cfg = _blocks(d, dv, backward=False)
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), b * h)
    _fwd[grid](
        q,
        k,
        v,
        g,
        out,
        out_u,
        lse,
        mass,
        kp_arg,
        sinks if sinks is not None else lse,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g.stride(),
        *out.stride(),
        skpb,
        h,
        h // k.shape[1],
        n,
        m,
        scale_log2,
        HAS_GATE=gate is not None,
        HAS_SINK=sinks is not None,
        WRITE_OU=write_ungated,
        SINK_TOKENS=sink_tokens,
        **meta,
        **cfg,
    )
    return out, out_u, lse, (mass if sink_tokens else None)


def _backward(q, k, v, dout_u, lse, delta, kp, causal, scale):
    (b, h, n, m, d, dv), meta, kp_arg, skpb, scale_log2 = _common(q, k, v, causal, kp, scale)
    hkv = k.shape[1]
    dk = torch.empty(b, h, m, meta["BLOCK_D"], device=q.device, dtype=torch.float32)
    dvv = torch.empty(b, h, m, meta["BLOCK_DV"], device=q.device, dtype=torch.float32)
    dq = torch.empty(b, h, n, meta["BLOCK_D"], device=q.device, dtype=torch.float32)
    cfg = _blocks(d, dv, backward=True)
    args = (*q.stride(), *k.stride(), *v.stride(), *dout_u.stride(), skpb, h, h // hkv, n, m, scale_log2, scale)
    _bwd_dkdv[(triton.cdiv(m, cfg["BLOCK_N"]), b * h)](
        q, k, v, dout_u, lse, delta, dk, dvv, kp_arg, *args, **meta, **cfg
    )
    _bwd_dq[(triton.cdiv(n, cfg["BLOCK_M"]), b * h)](q, k, v, dout_u, lse, delta, dq, kp_arg, *args, **meta, **cfg)
    group = lambda t, last: t[..., :last].view(b, hkv, h // hkv, m, last).sum(2)
    return dq[..., :d].to(q.dtype), group(dk, d).to(k.dtype), group(dvv, dv).to(v.dtype)


class _FlashGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, sinks, kp, causal, scale, sink_tokens):
        needs = ctx.needs_input_grad
        write_ungated = gate is not None and any(needs[:5])
        out, out_u, lse, mass = _forward(q, k, v, gate, sinks, kp, causal, scale, sink_tokens, write_ungated)
        ctx.save_for_backward(q, k, v, gate, sinks, kp, out_u, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse, *([mass] if mass is not None else []))
        return out, lse, mass

    @staticmethod
    def backward(ctx, dout, _dlse, _dmass):
        q, k, v, gate, sinks, kp, out_u, lse = ctx.saved_tensors
        dout_u = (dout * gate).to(q.dtype) if gate is not None else dout
        delta = (dout_u.float() * out_u.float()).sum(-1)  # rowsum(dO_u * O_u), (B, H, N)
        dq, dk, dv = _backward(q, k, v, dout_u.contiguous(), lse, delta, kp, ctx.causal, ctx.scale)
        dgate = (dout.float() * out_u.float()).sum_to_size(gate.shape).to(gate.dtype) if gate is not None else None
        dsinks = None
        if sinks is not None:  # the sink column has value 0: dS_sink = -P_sink * delta
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dgate, dsinks, None, None, None, None


def flash_gated_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    key_padding: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    sink_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused gated attention. Returns (out (B, Hq, N, Dv), lse (B, Hq, N) float32, mass (B, Hq, N) or None).

    lse includes the sink logit; mass is the probability on the first ``sink_tokens`` keys.
    """
    reason = supports(q, k, v)
    if reason:
        raise InputError(reason)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kp = None
    if key_padding is not None:
        kp = key_padding.to(device=q.device, dtype=torch.int8).expand(q.shape[0], k.shape[2]).contiguous()
    return _FlashGated.apply(q, k, v, gate, sinks, kp, bool(is_causal), scale, int(sink_tokens))
