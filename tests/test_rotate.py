"""Hadamard rotation (quantgate.quant.rotate): the float function is unchanged, outliers are spread,
and what cannot be rotated exactly is refused."""

import copy
import math
from typing import cast

import pytest
import torch
from transformers import PreTrainedModel

import quantgate as qg
from quantgate.models.record import record_of
from quantgate.models.swap import gate_parameters
from quantgate.quant.rotate import OnlineHadamard, UnitRMSNorm, check_rotatable, rotate_

VOCAB = 128


@torch.no_grad()
def tiny(preset="tiny-llama", variant=None, **overrides):
    """A tiny random model whose norms, gates and one residual channel are far from their defaults."""
    model = qg.build(preset, variant, vocab_size=VOCAB, **overrides).eval()
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("bias"):
            p.copy_(torch.randn_like(p) * 0.3)
        elif "norm" in name:  # gains 1 +- 0.3, x4 on the final norm: logits of O(1)-O(10)
            p.copy_((1 + torch.randn_like(p) * 0.3) * (1.0 if "layers" in name else 4.0))
    for p in gate_parameters(model).values():
        p.normal_(std=0.3)
    embeddings = cast(PreTrainedModel, model).get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    embeddings.weight[:, 5] *= 20  # a planted outlier channel in the stream
    return model


def ids(batch=2, n=12):
    return torch.randint(0, VOCAB, (batch, n))


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def assert_same_function(model, online=True, seed=0):
    x = ids()
    ref = logits(model, x)
    assert ref.abs().max() > 1.0
    info = rotate_(model, online=online, seed=seed)
    torch.testing.assert_close(logits(model, x), ref, atol=1e-4, rtol=0)
    return info


@pytest.mark.parametrize("online", [True, False])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-opt"])
def test_rotation_keeps_the_logits(preset, online):
    model = tiny(preset)
    info = assert_same_function(model, online)
    base = model.base_model
    norm = base.decoder.layers[0].self_attn_layer_norm if preset == "tiny-opt" else base.layers[0].input_layernorm
    assert isinstance(norm, UnitRMSNorm) and not list(norm.parameters())
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False
    assert record_of(model).rotation == info and info.online is online
    assert info.d_ff == (128 if online else None)
    # RMSNorm models add nothing; OPT's final LayerNorm bias becomes an LM-head bias
    assert info.extra_params == (VOCAB if preset == "tiny-opt" else 0)


@pytest.mark.parametrize(
    "preset, variant",
    [
        ("tiny-llama", "g1-elementwise"),
        ("tiny-llama", "g1-headwise"),
        ("tiny-llama", "g1-elementwise:low_rank=8"),
        ("tiny-llama", "g1-ns-sigmoid"),
        ("tiny-llama", "g1-headshared"),
        ("tiny-llama", "g2-value"),
        ("tiny-llama", "hyga:low_rank=4"),
        ("tiny-llama", "bondarenko:mode=all-heads"),
        ("tiny-opt", "g1-headwise"),
        ("tiny-opt", "hyga"),
        ("tiny-opt", "g1-constant+sink"),
    ],
)
def test_rotation_keeps_the_logits_of_gated_models(preset, variant):
    assert_same_function(tiny(preset, variant))


def test_sizes_that_are_not_powers_of_two():
    """d = 48 = 12 * 4 and d_ff = 160 = 40 * 4 use torchao's stored Hadamard blocks (K = 12, K = 40)."""
    model = tiny("tiny-qwen3", "g1-elementwise", hidden_size=48, intermediate_size=160)
    info = assert_same_function(model)
    assert info.extra_ops_per_token == 2 * 160 * (2 + 40 - 1)  # layers * d_ff * (log2(d_ff / K) + K - 1)


def test_extra_ops_per_token_formula():
    model = tiny("tiny-llama", num_hidden_layers=3, intermediate_size=256)
    info = rotate_(model)
    assert info.extra_ops_per_token == 3 * 256 * int(math.log2(256))  # K = 1: layers * d_ff * log2(d_ff)
    assert rotate_(tiny(), online=False).extra_ops_per_token == 0


def test_deepcopy_and_seeds():
    model = tiny("tiny-opt")
    twin = copy.deepcopy(model)
    x = ids()
    rotate_(model, seed=0)
    rotate_(twin, seed=1)
    dup = copy.deepcopy(model)
    assert any(isinstance(h, OnlineHadamard) for h in dup.base_model.decoder.layers[1].fc2._forward_pre_hooks.values())
    torch.testing.assert_close(logits(dup, x), logits(model, x), atol=0, rtol=0)
    torch.testing.assert_close(logits(twin, x), logits(model, x), atol=1e-4, rtol=0)
    assert not torch.equal(twin.base_model.decoder.embed_tokens.weight, model.base_model.decoder.embed_tokens.weight)


def test_later_pre_hooks_see_the_rotated_ffn_input():
    """An activation quantizer added after rotation (a pre-hook on down_proj) sees x M, M the Hadamard matrix."""
    from torchao.prototype.spinquant.hadamard_utils import hadamard_matrix

    model = tiny()
    seen: dict[str, torch.Tensor] = {}
    down = lambda m: m.base_model.layers[0].mlp.down_proj
    hook = lambda key: lambda mod, args: seen.__setitem__(key, args[0])
    x = ids()
    handle = down(model).register_forward_pre_hook(hook("before"))
    logits(model, x)
    handle.remove()
    rotate_(model)
    down(model).register_forward_pre_hook(hook("after"))
    logits(model, x)
    torch.testing.assert_close(seen["after"], seen["before"] @ hadamard_matrix(128, "cpu"), atol=1e-5, rtol=1e-5)


def test_rotation_spreads_a_massive_channel():
    def peak_over_rms(model):
        seen = []
        handle = model.base_model.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda mod, args: seen.append(args[0])
        )
        logits(model, ids(4, 16))
        handle.remove()
        x = seen[0].flatten(0, 1)
        return (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean().item()

    model = tiny(hidden_size=256)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 5] *= 100
    before = peak_over_rms(model)
    rotate_(model)
    after = peak_over_rms(model)
    assert before > 8 * after, (before, after)  # ~16 (of at most sqrt(256)) -> ~1.1


@pytest.mark.parametrize(
    "preset, overrides, match",
    [
        ("tiny-bert", {}, "cannot rotate a bert model: post-LN"),
        ("tiny-opt", {"do_layer_norm_before": False}, r"post-LN opt model \(do_layer_norm_before=False\)"),
        ("tiny-opt", {"word_embed_proj_dim": 32}, "project_in/project_out"),
        ("tiny-mla", {}, "cannot rotate a mla model: the attention reads the stream through latent"),
        ("tiny-qwen3-next", {}, "cannot rotate a qwen3-next model: linear-attention blocks"),
    ],
)
def test_refuses_families(preset, overrides, match):
    with pytest.raises(ValueError, match=match):
        rotate_(qg.build(preset, vocab_size=VOCAB, **overrides))


@pytest.mark.parametrize(
    "variant, match",
    [
        ("g5-output", "g5-output: it multiplies o_proj's output"),
        ("bondarenko", "bondarenko: it reads x in per-head slices"),
    ],
)
def test_refuses_gates_that_do_not_commute(variant, match):
    with pytest.raises(ValueError, match=match):
        rotate_(tiny("tiny-llama", variant))


def test_refuses_twice_and_unsupported_sizes_without_touching_the_model():
    model = tiny()
    rotate_(model)
    with pytest.raises(ValueError, match="already rotated"):
        rotate_(model)
    model = tiny(intermediate_size=100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"no Hadamard matrix of size 100 \(d_ff"):
        rotate_(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    check_rotatable(model, online=False)  # the residual rotation alone fits d_model = 64
    assert_same_function(model, online=False)


@pytest.mark.parametrize("n", [128, 1536])  # 1536 = 12 x 2^7: torchao's K = 12 block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_online_transform_is_x_times_the_hadamard_matrix_in_each_dtype(n, dtype):
    """x -> x M for torchao's normalized Hadamard M, against float64 by definition: float32 through the butterfly,
    bf16 through the exact +-1 matrix (one rounding of the float32-accumulated product, then 1/sqrt(n))."""
    from torchao.prototype.spinquant.hadamard_utils import get_hadK, matmul_hadU_slow

    hadK, K = get_hadK(n)
    m = matmul_hadU_slow(torch.eye(n, dtype=torch.float64), hadK, K)
    assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-12)  # orthonormal
    x = torch.randn(3, 7, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    (y,) = OnlineHadamard(hadK, K)(torch.nn.Linear(n, 4), (x,))
    exact = x.double() @ m
    assert y.dtype == dtype and y.shape == x.shape
    # bf16: oneDNN's GEMM rounds its sums to within 2^-8 (measured), then the scaling rounds once more
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((y.double() - exact).abs() <= tol * exact.abs() + 1e-6).all()
    if dtype == torch.bfloat16:  # and it beats the butterfly, which rounds at each of its stages
        butterfly = matmul_hadU_slow(x.contiguous(), hadK, K)
        rms = lambda t: (t.double() - exact).square().mean().sqrt()
        assert rms(y) < rms(butterfly)
