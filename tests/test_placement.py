"""Where simulated quantization puts its activation quantizers: Bondarenko et al.'s placement site by
site per family, one block quantized by hand against the simulation, and the attention gates."""

from collections import Counter
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

import quantgate as qg
from quantgate.models.families import family_of
from quantgate.quant.simulate import act_quantizers

IDS = torch.randint(5, 8000, (2, 16), generator=torch.Generator().manual_seed(1))
ATTENTION = ("q", "k", "v", "scores", "probs")

# the reference's sites in one block (quantgate/quant/simulate.py), as the quantizers name them
OPT = {
    "self_attn_layer_norm output",
    *(f"self_attn {t}" for t in ATTENTION),
    "self_attn.out_proj input",
    "self_attn.out_proj output",
    "final_layer_norm input",
    "final_layer_norm output",
    "fc2 input",
    "fc2 output",
    "output",
}
LLAMA = {
    "input_layernorm output",
    *(f"self_attn {t}" for t in ATTENTION),
    "self_attn.o_proj input",
    "self_attn.o_proj output",
    "post_attention_layernorm input",
    "post_attention_layernorm output",
    "mlp.down_proj input",
    "mlp output",
    "output",
}
BERT = {
    *(f"attention.self {t}" for t in ATTENTION),
    "attention.output.dense input",
    "attention.output.dense output",
    "attention.output.LayerNorm input",
    "attention.output.LayerNorm output",
    "output.dense input",
    "output.dense output",
    "output.LayerNorm input",
    "output.LayerNorm output",
}
OPT_POST_LN = OPT - {"output"} | {"self_attn_layer_norm input"}  # OPT-350m: norms after the residual sums
MLA_DENSE = LLAMA | {"self_attn.q_b_proj input", "self_attn.kv_b_proj input"}
MLA_MOE = MLA_DENSE - {"mlp.down_proj input"} | {"mlp.shared_experts.down_proj input"}
NEXT_LINEAR = {
    "input_layernorm output",
    "linear_attn.out_proj input",
    "linear_attn.out_proj output",
    "post_attention_layernorm input",
    "post_attention_layernorm output",
    "mlp.shared_expert.down_proj input",
    "mlp output",
    "output",
}


def _calib(n=2):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 8000, (2, 16), generator=g)} for _ in range(n)]


def _sites(q):
    """{block index or None (outside the blocks): Counter of site names relative to the block}."""
    blocks = [n for n, m in q.named_modules() if any(m is b for b in family_of(q).blocks(q))]
    out: dict[int | None, Counter[str]] = {}
    for quant in act_quantizers(q):
        owner, _, tensor = quant.name.rpartition(" ")
        i = next((i for i, b in enumerate(blocks) if owner == b or owner.startswith(b + ".")), None)
        rel = owner[len(blocks[i]) + 1 :] if i is not None else owner
        out.setdefault(i, Counter())[f"{rel} {tensor}".strip()] += 1
    return out


@pytest.mark.parametrize(
    "preset, per_block, outside, block0_extra",
    [
        ("tiny-opt", [OPT, OPT], {"model.decoder.final_layer_norm output"}, {"input"}),  # input: the embedding sum
        ("tiny-opt-post-ln", [OPT_POST_LN, OPT_POST_LN], set(), {"input"}),
        ("tiny-llama", [LLAMA, LLAMA], {"model.norm output"}, set()),
        ("tiny-bert", [BERT, BERT], {"bert.embeddings.LayerNorm input", "bert.embeddings.LayerNorm output"}, set()),
        ("tiny-mla", [MLA_DENSE, MLA_MOE], {"model.norm output"}, set()),
        ("tiny-qwen3-next", [NEXT_LINEAR, LLAMA], {"model.norm output"}, set()),
    ],
)
def test_bondarenko_sites_per_block_match_the_reference_list(preset, per_block, outside, block0_extra):
    overrides: dict[str, dict[str, Any]] = {
        "tiny-opt-post-ln": {"do_layer_norm_before": False},
        "tiny-mla": {"first_k_dense_replace": 1},  # block 1 MoE
        "tiny-qwen3-next": {  # block 0 linear attention and MoE
            "layer_types": ["linear_attention", "full_attention"],
            "mlp_only_layers": [1],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    }
    model = qg.build(preset.removesuffix("-post-ln"), **overrides.get(preset, {})).eval()
    q = qg.quantize(model, "w8a8-int8-bondarenko", calibration=_calib(1))
    sites = _sites(q)
    for i, expected in enumerate(per_block):
        assert sites[i] == Counter(expected | (block0_extra if i == 0 else set())), i
    assert sites.get(None, Counter()) == Counter(outside)
    with torch.no_grad():
        assert torch.isfinite(q(IDS).logits).all()


def test_linear_inputs_is_exactly_the_inputs_of_the_quantized_linears():
    q = qg.quantize(qg.build("tiny-llama"), "w8a8-int8-static", calibration=_calib(1))
    assert _sites(q)[0] == Counter(
        f"{p} input"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    )
    assert None not in _sites(q)  # nothing outside the blocks: the LM head is kept


# --- one block quantized by hand ----------------------------------------------------------------


def fq(x, site):
    """The reference's asymmetric 8-bit quantizer (uniform_quantizers.py) with a site's calibrated range."""
    lo, hi = site.lo.clamp(max=0.0), site.hi.clamp(min=0.0)
    scale = (hi - lo) / 255
    zero = torch.round(-lo / scale).clamp(0, 255)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def _attention(q, k, v, sites, scale, causal):
    """(B, H, N, D) heads in, (B, N, H * D) out: q, k, v, scores (before the mask) and probs quantized."""
    q, k, v = fq(q, sites["q"]), fq(k, sites["k"]), fq(v, sites["v"])
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = fq(q @ k.transpose(-1, -2) * scale, sites["scores"])
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    probs = fq(torch.softmax(scores, dim=-1), sites["probs"])
    return (probs @ v).transpose(1, 2).flatten(2)


def _heads(t, head_dim):
    return t.view(t.shape[0], t.shape[1], -1, head_dim).transpose(1, 2)


def _linear(x, layer):
    return F.linear(x, layer.weight, layer.bias)


def _layer_norm(x, ln):
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _rotate(t, cos, sin):
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def _opt_block(b, x, kw):
    a, ln1, ln2 = b.self_attn, b.self_attn_layer_norm, b.final_layer_norm
    h = fq(_layer_norm(x, ln1), ln1.output_quant)
    q, k, v = (_heads(_linear(h, p), a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
    ctx = fq(_attention(q * a.scaling, k, v, a.qg_fake_quant, 1.0, True), a.out_proj.input_quant)
    s1 = fq(x + fq(_linear(ctx, a.out_proj), a.out_proj.output_quant), ln2.input_quant)
    m = fq(torch.relu(_linear(fq(_layer_norm(s1, ln2), ln2.output_quant), b.fc1)), b.fc2.input_quant)
    return fq(s1 + fq(_linear(m, b.fc2), b.fc2.output_quant), b.output_quant)


def _llama_block(b, x, kw):
    a, ln1, ln2, mlp = b.self_attn, b.input_layernorm, b.post_attention_layernorm, b.mlp

    def rms(t, norm):
        return norm.weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    h = fq(rms(x, ln1), ln1.output_quant)
    q, k, v = (_heads(_linear(h, p), a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
    cos, sin = (t.unsqueeze(1) for t in kw["position_embeddings"])
    ctx = fq(
        _attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, a.qg_fake_quant, a.head_dim**-0.5, True),
        a.o_proj.input_quant,
    )
    s1 = fq(x + fq(_linear(ctx, a.o_proj), a.o_proj.output_quant), ln2.input_quant)
    h = fq(rms(s1, ln2), ln2.output_quant)
    m = fq(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj.input_quant)
    return fq(s1 + fq(_linear(m, mlp.down_proj), mlp.output_quant), b.output_quant)


def _bert_block(b, x, kw):
    a, out1, out2 = b.attention.self, b.attention.output, b.output
    q, k, v = (_heads(_linear(x, p), a.attention_head_size) for p in (a.query, a.key, a.value))
    ctx = fq(_attention(q, k, v, a.qg_fake_quant, a.attention_head_size**-0.5, False), out1.dense.input_quant)
    s1 = fq(fq(_linear(ctx, out1.dense), out1.dense.output_quant) + x, out1.LayerNorm.input_quant)
    h = fq(_layer_norm(s1, out1.LayerNorm), out1.LayerNorm.output_quant)
    m = fq(F.gelu(_linear(h, b.intermediate.dense)), out2.dense.input_quant)
    s2 = fq(fq(_linear(m, out2.dense), out2.dense.output_quant) + h, out2.LayerNorm.input_quant)
    return fq(_layer_norm(s2, out2.LayerNorm), out2.LayerNorm.output_quant)


@pytest.mark.parametrize(
    "preset, by_hand", [("tiny-opt", _opt_block), ("tiny-llama", _llama_block), ("tiny-bert", _bert_block)]
)
def test_one_block_quantized_by_hand_matches_the_simulation(preset, by_hand):
    q = qg.quantize(qg.build(preset, seed=2).eval(), "w8a8-int8-bondarenko", calibration=_calib())
    block = family_of(q).blocks(q)[1]
    seen: dict[str, Any] = {}  # the block's input, its keyword arguments and its output
    hooks = [
        block.register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0], kw=kw), with_kwargs=True),
        block.register_forward_hook(lambda m, a, o: seen.update(out=o)),
    ]
    with torch.no_grad():
        q(IDS)
        for h in hooks:
            h.remove()
        expected = by_hand(block, seen["x"], seen["kw"])
    assert len(torch.unique(expected)) < expected.numel() / 4  # on the output site's grid: it really quantized
    torch.testing.assert_close(seen["out"], expected, rtol=1e-5, atol=1e-6)


# --- what stays in full precision ---------------------------------------------------------------


@pytest.mark.parametrize("acts", ["linear-inputs", "bondarenko"])
def test_attention_gates_stay_in_full_precision_unless_asked(acts):
    model = qg.build("tiny-llama", "g1-elementwise", seed=0).eval()
    proj = "model.layers.0.self_attn.gate.proj"
    w = cast(torch.Tensor, model.get_submodule(proj).weight).detach().clone()
    for gates, quantized in ((False, False), (True, True)):
        q = qg.quantize(model, f"w8a8-int8-static:acts={acts},gates={str(gates).lower()}", calibration=_calib(1))
        gate_sites = {x.name for x in act_quantizers(q) if ".gate." in x.name}
        assert bool(gate_sites) == quantized
        assert (not torch.equal(cast(torch.Tensor, q.get_submodule(proj).weight), w)) == quantized
    assert gate_sites >= {f"{proj} input"} | ({f"{proj} output"} if acts == "bondarenko" else set())


def test_bondarenko_weights_embeddings_and_norms_but_not_the_head():
    model = qg.build("tiny-bert", seed=0).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.1)  # a trained norm's weights, not all ones
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = qg.quantize(model, "w8a8-int8-bondarenko", calibration=_calib(1))
    after = q.state_dict()
    for name in (
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.encoder.layer.0.output.LayerNorm.weight",
        "bert.encoder.layer.1.attention.self.query.weight",
    ):
        assert len(torch.unique(after[name])) <= 255 and not torch.equal(after[name], before[name]), name
    for name, value in after.items():  # BERT's whole MLM head stays in float, as the reference keeps it
        if name.startswith("cls."):
            assert torch.equal(value, before[name]), name
    assert not any(x.name.startswith("cls") for x in act_quantizers(q))


def test_w8a16_and_w16a8_split_bondarenkos_w8a8_into_its_weight_and_activation_parts():
    model = qg.build("tiny-llama", seed=0).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = qg.quantize(model, "w8a8-int8-bondarenko", calibration=_calib(1))
    weights = qg.quantize(model, "w8a16-int8-bondarenko")
    acts = qg.quantize(model, "w16a8-int8-bondarenko", calibration=_calib(1))
    for name, value in full.state_dict().items():
        if name in before:  # W8A16 writes exactly W8A8's weights; W16A8 leaves every weight as it was
            assert torch.equal(weights.state_dict()[name], value), name
            assert torch.equal(acts.state_dict()[name], before[name]), name
    assert not act_quantizers(weights)
    assert _sites(acts) == _sites(full)
