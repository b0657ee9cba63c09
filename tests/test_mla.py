"""The MLA family (DeepSeek-V3 latent attention): pretrained weights, sink mass with q/k head dim !=
v head dim, gate costs, and observe / quantize / evaluate / train unchanged."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import quantgate as qg
from quantgate.models import attention_modules
from quantgate.models.cost import GateCost, gate_cost
from quantgate.models.families import config_of
from quantgate.train import TrainConfig, train

IDS = torch.randint(5, 8192, (2, 13))


def test_presets_are_dense_mla_with_different_qk_and_v_head_dims():
    model = qg.build("tiny-mla")
    c = config_of(model)
    assert c.model_type == "deepseek_v3" and c.first_k_dense_replace == c.num_hidden_layers
    assert c.qk_nope_head_dim + c.qk_rope_head_dim != c.v_head_dim
    attn = attention_modules(model)[0]
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= {
        n for n, _ in attn.named_children()
    }
    assert config_of(qg.build("small-mla")).v_head_dim == 64


def test_plain_deepseek_checkpoint_loads_and_takes_kimis_channel_gate(tmp_path):
    config = config_of(qg.build("tiny-mla")).to_dict()
    config.pop("quantgate")
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        plain = qg.load(tmp_path / "hf")
        assert torch.equal(plain(IDS).logits, hf(IDS).logits)
        gated = qg.load(tmp_path / "hf", variant="g1-elementwise")
    for name, p in gated.named_parameters():
        if ".gate." not in name:
            assert torch.equal(p, hf.get_parameter(name)), name
    gate_weight = attention_modules(gated)[0].get_parameter("gate.proj.weight")
    assert gate_weight.shape == (4 * 16, 64)  # full rank: every (head, value channel) from x


def test_sink_mass_from_the_lse_path_equals_eager():
    """q/k head 24 (16 + 8 RoPE), v head 16: the O(N) path must not assume equal head dims."""
    ids = torch.randint(5, 8192, (2, 40))
    masses = {}
    for backend in ("eager", "sdpa"):
        model = qg.build("tiny-mla", "g1-headwise", backend=backend, seed=1)
        report = qg.observe(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], progress=False)
        masses[backend] = [L.sink_mass for L in report.layers]
    assert torch.allclose(torch.tensor(masses["sdpa"]), torch.tensor(masses["eager"]), atol=1e-5)
    assert all(m is not None and 0 < m < 1 for m in masses["sdpa"])


def test_gate_costs_count_value_head_channels():
    """tiny-mla: d=64, 4 heads x v 16 = 64 gated channels per layer, 2 layers."""
    g1 = gate_cost(qg.build("tiny-mla", "g1-elementwise"))
    head = gate_cost(qg.build("tiny-mla", "g1-headwise"))
    low = gate_cost(qg.build("tiny-mla", "hyga:low_rank=8,h_gate=false,c_gate=false"))
    assert g1 == GateCost(2 * (64 * 64 + 64), 2 * 2 * 64 * 64)
    assert head == GateCost(2 * (64 * 4 + 4), 2 * 2 * 64 * 4)
    assert low.gate_flops_per_token < g1.gate_flops_per_token


def test_quantize_evaluate_and_train_unchanged(tmp_path):
    model = qg.build("tiny-mla", "g1-elementwise")
    tok = qg.tokenizer(model)
    out = train(
        model,
        tok,
        config=TrainConfig(steps=3, batch_size=2, seq_len=32, log_every=1, eval_batches=1, out=str(tmp_path / "run")),
    )
    q = qg.quantize(out, "w8a8-int8-dynamic")
    with torch.no_grad():
        assert torch.isfinite(q(IDS).logits).all()
    res = qg.evaluate(q, tok, ["quantgate_ppl"], limit=1).results["quantgate_ppl"]
    assert res["word_perplexity"] > 1
