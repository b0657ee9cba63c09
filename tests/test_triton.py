"""The fused Triton gated-SDPA kernel against the eager reference, on the CPU through Triton's interpreter.

float32 only: the interpreter's bf16 tl.dot is wrong. conftest.py sets TRITON_INTERPRET=1. Skipped where
triton is not installed.
"""

import zlib
from pathlib import Path

import pytest
import torch
from conftest import run_python

pytest.importorskip("triton")

import quantgate as qg
from quantgate.attention import sdpa, triton_sdpa
from quantgate.attention.sdpa import gated_sdpa

pytestmark = pytest.mark.skipif(not triton_sdpa.INTERPRET, reason="triton was imported before TRITON_INTERPRET=1")

B = 2


def _reference_lse(q, k, mask, causal, scale, sinks):
    h = q.shape[1]
    s = (q @ k.repeat_interleave(h // k.shape[1], 1).transpose(-1, -2)) * scale
    valid = mask.expand(s.shape).clone()
    if causal:
        valid &= torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    s = s.masked_fill(~valid, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, h, 1, 1).expand(*s.shape[:3], 1)], -1)
    return torch.logsumexp(s, -1)


CASES = {
    # name: (Hq, Hkv, N, M, D, Dv, causal, gate shape, sinks, padded)
    "causal-gqa-odd-elementwise-sinks": (4, 2, 37, 37, 16, 16, True, "elementwise", True, False),
    "padded-cross-headwise": (2, 1, 20, 29, 64, 64, False, "headwise", False, True),
    "padded-causal-constant-gate-dv-differs": (4, 4, 33, 33, 24, 40, True, "constant", True, True),
    "ungated-d128": (2, 2, 18, 18, 128, 128, True, None, False, False),
}


def _inputs(case, seed):
    hq, hkv, n, m, d, dv, causal, gate_kind, with_sinks, padded = case
    g = torch.Generator().manual_seed(seed)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()
    q, k, v = leaf(B, hq, n, d), leaf(B, hkv, m, d), leaf(B, hkv, m, dv)
    gate_shape = {"elementwise": (B, hq, n, dv), "headwise": (B, hq, n, 1), "constant": (1, hq, 1, dv)}.get(gate_kind)
    gate = torch.rand(*gate_shape, generator=g).requires_grad_() if gate_shape else None
    sinks = leaf(hq) if with_sinks else None
    kp = torch.ones(B, m, dtype=torch.bool)
    if padded:  # batch 1: right padding; batch 0: left padding, so some causal rows see no key at all
        kp[1, m - 7 :] = False
        kp[0, :3] = False
    return q, k, v, gate, sinks, kp, causal


@pytest.mark.parametrize("name", list(CASES))
def test_forward_lse_mass_and_gradients_match_eager(name):
    q, k, v, gate, sinks, kp, causal = _inputs(CASES[name], seed=zlib.crc32(name.encode()))
    mask = kp[:, None, None, :]
    probe = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])  # a generic upstream gradient
    leaves = [t for t in (q, k, v, gate, sinks) if t is not None]
    results = {}
    for backend in ("eager", "triton"):
        out, mass = gated_sdpa(
            q, k, v, gate, attn_mask=mask, is_causal=causal, sinks=sinks, backend=backend, sink_tokens=3
        )
        grads = torch.autograd.grad((out * probe).sum(), leaves)
        results[backend] = (out, mass, *grads)
    for ref, got in zip(results["eager"], results["triton"], strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert results["eager"][1].min() < 0.9  # the mass is not trivially all on the first keys
    _, lse, _ = triton_sdpa.flash_gated_sdpa(q, k, v, gate, key_padding=kp, is_causal=causal, sinks=sinks)
    ref = _reference_lse(q, k, mask, causal, q.shape[-1] ** -0.5, sinks)
    torch.testing.assert_close(lse, ref, atol=2e-5, rtol=1e-5)


def test_transformers_padded_causal_mask_is_recognised():
    q, k, v, gate, sinks, kp, _ = _inputs(CASES["padded-causal-constant-gate-dv-differs"], seed=3)
    n = q.shape[2]
    full = kp[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()  # what sdpa_mask builds
    assert sdpa._key_padding(full, False, n, n)[1] is True
    with torch.no_grad():
        ref = gated_sdpa(q, k, v, gate, attn_mask=full, sinks=sinks, backend="eager")
        got = gated_sdpa(q, k, v, gate, attn_mask=full, sinks=sinks, backend="triton")
    assert isinstance(got, torch.Tensor)  # no sink_tokens: the output alone
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert got[0, :, :3].abs().max() == 0  # rows with no key to attend to are zero, as in eager
    sliding = full & torch.ones(n, n, dtype=torch.bool).triu(-4)  # not causal & padding: another backend
    assert sdpa._key_padding(sliding, False, n, n) is None


def test_unsupported_calls_fall_back_with_a_warning(caplog):
    q, k, v, gate, _, _, _ = _inputs(CASES["causal-gqa-odd-elementwise-sinks"], seed=5)
    with torch.no_grad():
        ref = gated_sdpa(q, k, v, gate, is_causal=True, clip=(-0.02, 1.0), backend="eager")
        with caplog.at_level("WARNING", logger="quantgate"):
            got = gated_sdpa(q, k, v, gate, is_causal=True, clip=(-0.02, 1.0), backend="triton")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert "clipped softmax" in caplog.text


def test_triton_backend_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_sdpa, "INTERPRET", False)
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gated_sdpa(q, q, q, backend="triton")
    out = gated_sdpa(q, q, q, backend="auto")
    assert isinstance(out, torch.Tensor) and out.shape == q.shape  # auto on a CPU never asks for triton


@pytest.mark.parametrize("variant", ["g1-elementwise", "g1-headwise+sink"])
def test_model_trains_identically_on_triton_and_sdpa(variant, monkeypatch):
    """Two AdamW steps of a tiny Llama: same losses and weights with the kernel as with torch's SDPA."""
    calls: list[int] = []
    kernel = triton_sdpa.flash_gated_sdpa

    def counted_kernel(*a, **kw):
        calls.append(1)
        return kernel(*a, **kw)

    monkeypatch.setattr(triton_sdpa, "flash_gated_sdpa", counted_kernel)
    torch.manual_seed(0)
    ids = torch.randint(5, 128, (2, 20))
    ids[1, 15:] = 0
    attn = torch.ones_like(ids)
    attn[1, 15:] = 0  # a padded batch: exercises the key-padding path
    runs = {}
    for backend in ("sdpa", "triton"):
        model = qg.build("tiny-llama", variant, backend=backend, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = model(ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[backend] = (losses, torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert len(calls) == 2 * 2  # every attention call of the triton run went through the kernel (2 layers x 2 steps)
    assert runs["triton"][0] == pytest.approx(runs["sdpa"][0], abs=1e-5)
    assert runs["sdpa"][0][-1] < runs["sdpa"][0][0]  # it did train
    torch.testing.assert_close(runs["triton"][1], runs["sdpa"][1], atol=1e-4, rtol=1e-4)


def test_benchmark_dry_run(tmp_path):
    """benchmarks/gated_sdpa.py end to end on the interpreter, so the GPU script cannot rot."""
    out = tmp_path / "gated_sdpa.md"
    root = Path(__file__).resolve().parents[1]
    run_python(
        [str(root / "benchmarks" / "gated_sdpa.py"), "--dry-run", "--out", str(out)],
        check=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=600,
    )
    text = out.read_text()
    for method in ("(a) sdpa, ungated", "(b) sdpa * gate", "(c) compiled (b)", "(d) fused triton"):
        assert text.count(method) == 1
    assert "target <= 1.05" in text and "target >= 1.2" in text
