"""Variants swapped into real transformers models: forward/backward, gate placement, padding."""

from typing import Any, cast

import pytest
import torch
from conftest import ALL_VARIANTS, FAMILY_PRESETS, GATED, build_or_refuse

import quantgate as qg
from quantgate.attention.gates import Gate
from quantgate.models import attention_modules, family_of
from quantgate.models.families import get_family

IDS = torch.randint(5, 8192, (2, 11))


def _open_all(model):
    for module in model.modules():
        if isinstance(module, Gate):
            module.open_()


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_forward_backward_reaches_the_gate(preset, variant):
    model = build_or_refuse(preset, variant)
    if model is None:
        return
    model.train()
    labels = IDS.clone()
    out = model(IDS, labels=labels)
    assert torch.isfinite(out.loss) and 8.5 < out.loss.item() < 9.6  # ~ln(8192) at init
    out.loss.backward()
    extra = qg.gate_parameters(model)
    if variant != "vanilla" and not variant.startswith("clipped"):
        assert extra, "the variant added no parameters"
    for name, p in extra.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("variant", ["g1-elementwise", "g1-elementwise+sink", "g1-elementwise+clipped"])
def test_qwen3_next_builtin_gate(variant):
    model = qg.build("tiny-qwen3-next", variant)
    out = model(IDS, labels=IDS)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    q_proj = cast(torch.nn.Linear, attention_modules(model)[0].q_proj)
    assert q_proj.out_features == 2 * 4 * 16  # queries and the built-in gate
    with pytest.raises(ValueError, match="built-in g1-elementwise gate"):
        qg.build("tiny-qwen3-next", "g1-headwise")


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("variant", GATED)
def test_open_gate_equals_ungated_model(preset, variant):
    base = qg.build(preset, seed=3).eval()
    gated = build_or_refuse(preset, variant, seed=4)
    if gated is None:
        return
    gated.eval()
    missing, unexpected = gated.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and set(missing) == set(qg.gate_parameters(gated))
    _open_all(gated)
    with torch.no_grad():
        assert torch.equal(gated(IDS).logits, base(IDS).logits)
        for name, p in qg.gate_parameters(gated).items():  # closed gates: the output must change
            p.fill_(-30.0 if name.endswith(("bias", "logit")) else 0.0)
        assert (gated(IDS).logits - base(IDS).logits).abs().max() > 1e-3


def _capture(module, store, key, use_input=False):
    def hook(mod, args, kwargs, output):
        if use_input:
            store[key] = (args[0] if args else kwargs["hidden_states"]).detach()
        else:
            store[key] = (output[0] if isinstance(output, tuple) else output).detach()

    return module.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bert", "tiny-opt"])
@pytest.mark.parametrize(
    "variant", ["g1-elementwise", "g1-headwise", "g1-headshared", "bondarenko", "g2-value", "g5-output", "hyga"]
)
def test_gate_sits_where_the_variant_says(preset, variant):
    """Same weights with and without the gate: the tensor at the gate's position is the ungated one
    times the gate computed by hand from the attention input x."""
    base = qg.build(preset, seed=1).eval()
    gated = qg.build(preset, variant, seed=2).eval()
    gated.load_state_dict(base.state_dict(), strict=False)
    family = family_of(base)
    b_block, g_block = family.blocks(base)[0], family.blocks(gated)[0]  # same input x in both
    attn = g_block.get_submodule(family.attention)
    seen: dict[str, torch.Tensor] = {}
    hooks = [_capture(g_block.get_submodule(family.attention), seen, "x_g", use_input=True)]
    for name, block in (("b", b_block), ("g", g_block)):
        hooks += [
            _capture(block.get_submodule(family.v_proj), seen, f"v_{name}"),
            _capture(block.get_submodule(family.o_proj), seen, f"o_in_{name}", use_input=True),
            _capture(block.get_submodule(family.o_proj), seen, f"o_out_{name}"),
        ]
    with torch.no_grad():
        base(IDS), gated(IDS)
        x = seen["x_g"]
        gate = cast(Gate, attn.gate)
        if gate.position == "value":
            assert torch.allclose(seen["v_g"], seen["v_b"] * gate(x), atol=1e-6)
        elif gate.position == "output":
            assert torch.allclose(seen["o_in_g"], seen["o_in_b"], atol=1e-6)  # untouched before W_O
            assert torch.allclose(seen["o_out_g"], seen["o_out_b"] * gate(x), atol=1e-6)
        else:
            b, n, _ = seen["o_in_b"].shape
            h = seen["o_in_b"].view(b, n, gate.dims.n_heads, -1).transpose(1, 2)  # ungated SDPA output
            g = gate(x, h) if gate.needs_output else gate(x)
            expected = (h * g).transpose(1, 2).reshape(b, n, -1)
            assert torch.allclose(seen["o_in_g"], expected, atol=1e-6)
            assert torch.allclose(seen["v_g"], seen["v_b"])
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("variant", ["vanilla", "g1-headwise+sink", "clipped:gamma=-0.01", "g2-value"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_padded_batch_equals_unpadded_sequences(preset, variant, backend):
    model = build_or_refuse(preset, variant, backend=backend)
    if model is None:
        return
    model.eval()
    lengths = [11, 7, 4]
    ids = torch.randint(5, 8192, (3, 11))
    mask = (torch.arange(11)[None] < torch.tensor(lengths)[:, None]).long()
    ids_padded = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        batch = model(ids_padded, attention_mask=mask).logits
        for i, n in enumerate(lengths):
            alone = model(ids[i : i + 1, :n]).logits[0]
            assert (batch[i, :n] - alone).abs().max() < 1e-4, (i, n)


def test_backends_agree_inside_a_model():
    ids = torch.randint(5, 8192, (2, 9))
    eager = qg.build("tiny-qwen3", "hyga+sink", backend="eager").eval()
    fast = qg.build("tiny-qwen3", "hyga+sink", backend="sdpa").eval()
    with torch.no_grad():
        assert (eager(ids).logits - fast(ids).logits).abs().max() < 1e-5
    qg.set_backend(fast, "eager")
    assert {a.qg_backend for a in attention_modules(fast)} == {"eager"}
    with pytest.raises(ValueError, match="unknown attention backend"):
        qg.set_backend(fast, "flashy")


def test_gate_parameters_exclude_routers_and_mlp_gates():
    moe = qg.build("tiny-qwen3-next")
    assert qg.gate_parameters(moe) == {}  # its gate lives in q_proj; mlp.gate is a router
    llama = qg.build("tiny-llama", "g1-headwise")
    names = set(qg.gate_parameters(llama))
    assert names == {f"model.layers.{i}.self_attn.gate.{p}" for i in (0, 1) for p in ("proj.weight", "proj.bias")}
    assert all("gate_proj" not in n for n in names)


def test_gate_initialisation_follows_pi_init():
    model = qg.build("tiny-llama", "g1-headwise:pi_init=0.25")
    gate = cast(Gate, attention_modules(model)[0].gate)
    x = torch.zeros(1, 3, 64)
    assert torch.allclose(gate(x), torch.full((1, 4, 3, 1), 0.25))
    ns = cast(Gate, attention_modules(qg.build("tiny-llama", "g1-ns-sigmoid"))[0].gate)
    assert torch.allclose(ns(x), torch.full((1, 4, 3, 16), 0.75))


def test_variant_reapplication_is_refused():
    model = qg.build("tiny-opt", "g1-headwise")
    assert qg.apply_variant(model, "g1-headwise") is model  # same variant: nothing to do
    with pytest.raises(ValueError, match="already has variant g1-headwise"):
        qg.apply_variant(model, "hyga")


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown preset 'tiny-gpt'; valid: tiny-bert"):
        qg.build("tiny-gpt")
    with pytest.raises(ValueError, match="unknown model family"):
        get_family("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; quantgate families: bert"):
        qg.apply_variant(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), "g1-headwise")


def test_bondarenko_needs_divisible_slices():
    from quantgate.attention.gates import AttentionDims, build_gate

    spec = qg.AttentionVariant.parse("bondarenko").gate
    assert spec is not None
    with pytest.raises(ValueError, match="mode=all-heads"):
        build_gate(spec, AttentionDims(d_model=64, n_heads=3, n_kv_heads=1, head_dim=16))
    wide = qg.AttentionVariant.parse("bondarenko:mode=all-heads").gate
    assert wide is not None
    assert build_gate(wide, AttentionDims(64, 3, 1, 16))(torch.zeros(2, 5, 64)).shape == (2, 3, 5, 1)


def test_gate_cost_against_a_hand_count():
    """tiny-llama: 2 layers, d=64, 4 heads x 16. G1 elementwise: W (64 x 64) + b (64) per layer, one
    multiply-add per weight per token; headwise: 64 x 4 + 4; input-independent: no per-token matmul."""
    from quantgate.models.cost import GateCost, gate_cost

    cost = {
        v: gate_cost(qg.build("tiny-llama", v)) for v in ("vanilla", "g1-elementwise", "g1-headwise", "g1-constant")
    }
    assert cost["vanilla"] == GateCost(0, 0.0)
    assert cost["g1-elementwise"] == GateCost(2 * (64 * 64 + 64), 2 * 2 * 64 * 64)
    assert cost["g1-headwise"] == GateCost(2 * (64 * 4 + 4), 2 * 2 * 64 * 4)
    assert cost["g1-constant"] == GateCost(2 * 64, 0.0)


def test_a_built_in_gate_costs_the_q_proj_rows_that_compute_it():
    """Qwen3-Next's gate is the second half of each head's q_proj slice: no plain-attention twin to run, so its cost
    is those rows, counted by hand: per attention block (heads x head_dim) x hidden weights, 2 FLOPs each."""
    from quantgate.models.cost import gate_cost
    from quantgate.models.families import family_of

    model = qg.build("tiny-qwen3-next", seed=0)
    family = family_of(model)
    blocks = family.attention_blocks(model)
    cfg = cast(Any, model.config)
    rows = cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size  # the gate half of q_proj (bias-free)
    assert all(b.get_submodule(family.q_proj).bias is None for b in blocks)
    cost = gate_cost(model)
    assert cost.gate_params == len(blocks) * rows and cost.gate_flops_per_token == 2.0 * len(blocks) * rows
