"""gated_sdpa: the fast backend against the eager reference on fresh random inputs."""

import pytest
import torch

from quantgate.attention import gated_sdpa

B, HQ, HKV, N, D = 3, 6, 2, 13, 16


def _inputs(hkv=HKV, n=N, m=None, grad=False):
    m = n if m is None else m
    q = torch.randn(B, HQ, n, D, requires_grad=grad)
    k = torch.randn(B, hkv, m, D, requires_grad=grad)
    v = torch.randn(B, hkv, m, D, requires_grad=grad)
    return q, k, v


def _padding_mask(n=N, lengths=(N, 9, 4)):
    valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, M)
    return valid[:, None, None, :]  # (B, 1, 1, M), True = attend


def _masks():
    pad = _padding_mask()
    additive = torch.zeros(B, 1, N, N).masked_fill(~pad.expand(B, 1, N, N), float("-inf"))
    return {"none": None, "padding": pad, "padding-4d": pad.expand(B, 1, N, N).clone(), "additive": additive}


GATES = {
    "none": None,
    "elementwise": (B, HQ, N, D),
    "headwise": (B, HQ, N, 1),
    "constant": (1, HQ, 1, D),
    "headshared": (B, 1, N, D),
}


@pytest.mark.parametrize("hkv", [HQ, HKV, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", list(_masks()))
@pytest.mark.parametrize("gate", list(GATES))
def test_sdpa_matches_eager(hkv, causal, mask, gate):
    q, k, v = _inputs(hkv)
    shape = GATES[gate]
    g = torch.rand(shape) if shape else None
    m = _masks()[mask]
    ref = gated_sdpa(q, k, v, g, attn_mask=m, is_causal=causal, backend="eager")
    out = gated_sdpa(q, k, v, g, attn_mask=m, is_causal=causal, backend="sdpa")
    assert isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)  # no sink_tokens: no mass
    assert out.shape == (B, HQ, N, D)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink_tokens", [1, 4])
@pytest.mark.parametrize("sinks", [False, True])
def test_sink_mass_from_lse_equals_eager_probabilities(causal, sink_tokens, sinks):
    q, k, v = _inputs()
    m = _padding_mask()
    s = torch.randn(HQ) if sinks else None
    # the reference: eager's probabilities summed over the first keys, computed by hand here
    kr = k.repeat_interleave(HQ // HKV, 1)
    scores = (q @ kr.transpose(-1, -2)) * D**-0.5
    allowed = m & (torch.ones(N, N, dtype=torch.bool).tril() if causal else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks:
        assert s is not None
        scores = torch.cat([scores, s.view(1, HQ, 1, 1).expand(B, HQ, N, 1)], -1)
    probs = scores.softmax(-1)
    expected = probs[..., :sink_tokens].sum(-1)
    for backend in ("eager", "sdpa"):
        out, mass = gated_sdpa(
            q, k, v, attn_mask=m, is_causal=causal, sinks=s, backend=backend, sink_tokens=sink_tokens
        )
        assert mass.shape == (B, HQ, N)
        assert (mass - expected).abs().max() < 1e-5, backend
    ref = probs[..., :N] @ v.repeat_interleave(HQ // HKV, 1)
    assert (out - ref).abs().max() < 1e-5


def test_sink_mass_path_keeps_gradients_of_the_output():
    q, k, v = _inputs(grad=True)
    g = torch.rand(B, HQ, N, D, requires_grad=True)
    grads = []
    for backend, tokens in (("eager", 0), ("sdpa", 2)):
        res = gated_sdpa(q, k, v, g, is_causal=True, backend=backend, sink_tokens=tokens)
        out = res[0] if tokens else res
        assert isinstance(out, torch.Tensor)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, g)))
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_eager(causal):
    q, k, v = _inputs(grad=True)
    g = torch.rand(B, HQ, N, 1, requires_grad=True)
    m = _padding_mask()
    grads = []
    for backend in ("eager", "sdpa"):
        out = gated_sdpa(q, k, v, g, attn_mask=m, is_causal=causal, backend=backend)
        assert isinstance(out, torch.Tensor)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, D)).sum(), (q, k, v, g)))
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() < 1e-4


def test_clipped_softmax_definition_and_fallback():
    q, k, v = _inputs()
    gamma, zeta = -0.1, 1.05
    probs = ((q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * D**-0.5).softmax(-1)
    clipped = ((zeta - gamma) * probs + gamma).clamp(0, 1)
    expected = clipped @ v.repeat_interleave(3, 1)
    for backend in ("eager", "sdpa", "auto"):  # sdpa cannot clip: it falls back to eager
        out = gated_sdpa(q, k, v, clip=(gamma, zeta), backend=backend)
        assert (out - expected).abs().max() < 1e-5
    assert (clipped == 0).any() and (clipped == 1).sum() == 0  # the clip really acts on small probabilities


def test_learned_sinks_train_through_eager_fallback():
    q, k, v = _inputs(grad=True)
    s = torch.zeros(HQ, requires_grad=True)
    out = gated_sdpa(q, k, v, sinks=s, is_causal=True, backend="sdpa")
    assert isinstance(out, torch.Tensor)
    out.sum().backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    with torch.no_grad():  # without autograd the O(N) sdpa path runs and agrees
        fast = gated_sdpa(q, k, v, sinks=s, is_causal=True, backend="sdpa")
    assert isinstance(fast, torch.Tensor)
    assert (fast - out).abs().max() < 1e-5


def test_fully_masked_rows_attend_to_nothing():
    q, k, v = _inputs()
    m = torch.ones(B, 1, N, N, dtype=torch.bool)
    m[:, :, 2] = False  # query 2 may see no key
    for backend in ("eager", "sdpa"):
        out, mass = gated_sdpa(q, k, v, attn_mask=m, backend=backend, sink_tokens=1)
        assert torch.isfinite(out).all() and out[:, :, 2].abs().max() == 0
        assert mass[:, :, 2].abs().max() == 0 and torch.isfinite(mass).all()


def test_cross_lengths_and_dropout_shapes():
    q, k, v = _inputs(m=N + 5)
    ref = gated_sdpa(q, k, v, backend="eager")
    out = gated_sdpa(q, k, v, backend="sdpa")
    assert isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)
    assert (out - ref).abs().max() < 1e-5
    torch.manual_seed(1)
    dropped = gated_sdpa(q, k, v, backend="eager", dropout_p=0.5)
    assert isinstance(dropped, torch.Tensor)
    assert dropped.shape == ref.shape and not torch.allclose(dropped, ref)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"backend": "cuda-magic"}, "unknown gated_sdpa backend"),
        ({"sinks": torch.zeros(5)}, "sinks must have shape"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=fragment):
        gated_sdpa(q, k, v, **kwargs)


def test_heads_must_divide():
    q = torch.randn(1, 5, 4, 8)
    k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        gated_sdpa(q, k, v)
