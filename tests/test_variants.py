import math
from typing import cast

import pytest
import torch
from conftest import ALL_VARIANTS
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.attention.gates import Gate
from quantgate.variants import GATE_KINDS, AttentionVariant, ClipSpec, GateSpec, SinkSpec

TEXTS = [
    *ALL_VARIANTS,
    "g1-elementwise:pi_init=0.25,low_rank=16",
    "bondarenko:mode=mlp,pi_init=0.1",
    "hyga:d_int=32,c_gate=false+sink:init=-1.5",
    "clipped:gamma=-0.1,zeta=1.003",
    "g1-ns-sigmoid:pi_init=0.9+clipped:alpha=12",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    v = AttentionVariant.parse(text)
    assert AttentionVariant.parse(str(v)) == v
    assert str(AttentionVariant.parse(str(v))) == str(v)


def test_parsed_fields():
    v = AttentionVariant.parse("hyga:d_int=32,fusion=product+clipped:alpha=4+sink:init=-2")
    assert v.gate == GateSpec("hyga", 0.5, 32, (("fusion", "product"),))
    assert v.gate.option("c_gate") is True and v.gate.option("h_gate") is True
    assert v.clip == ClipSpec(gamma=None, alpha=4.0)
    assert v.clip.params(100) == (-0.04, 1.0)  # gamma = -alpha / T
    assert v.sink == SinkSpec(-2.0)
    assert str(v) == "hyga:low_rank=32,fusion=product+clipped:alpha=4.0+sink:init=-2.0"


def test_defaults_and_bias_init():
    assert AttentionVariant.parse("vanilla").is_vanilla and str(AttentionVariant()) == "vanilla"
    clip = AttentionVariant.parse("clipped").clip
    assert clip is not None and clip.params(7) == (-0.025, 1.0)
    bondarenko = AttentionVariant.parse("bondarenko").gate
    assert bondarenko is not None and bondarenko.pi_init == 0.25
    g = AttentionVariant.parse("g1-headwise:pi_init=0.25").gate
    assert g is not None
    assert g.bias_init == pytest.approx(math.log(0.25 / 0.75))
    ns = AttentionVariant.parse("g1-ns-sigmoid:pi_init=0.9").gate  # 0.5 + 0.5 * sigmoid(b) = 0.9
    assert ns is not None
    assert 0.5 + 0.5 / (1 + math.exp(-ns.bias_init)) == pytest.approx(0.9)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("g9-magic", "valid: vanilla, g1-elementwise"),
        ("g1-elementwise:mode=mlp", "valid: pi_init, low_rank"),
        ("g1-constant:low_rank=4", "low_rank"),
        ("bondarenko:mode=deep", "mode must be one of"),
        ("hyga:fusion=max", "fusion must be one of"),
        ("g1-headwise:pi_init=1.5", "pi_init must lie in"),
        ("g1-ns-sigmoid:pi_init=0.3", "pi_init must lie in (0.5, 1)"),
        ("clipped:gamma=0.1", "gamma must be in [-10000, 0]"),
        ("clipped:gamma=-0.1,alpha=2", "exactly one of gamma"),
        ("g1-headwise+g2-value", "more than one gate"),
        ("vanilla+sink", "combines with nothing"),
        ("sink:init=abc", "init expects float"),
        ("hyga:c_gate=maybe", "c_gate expects bool"),
    ],
)
def test_bad_variants_name_the_problem(text, fragment):
    with pytest.raises(ValueError) as err:
        AttentionVariant.parse(text)
    assert fragment in str(err.value)


D, H, KV, DH = 64, 4, 2, 16  # tiny-llama: width, query / kv heads, head dim; 2 layers
GATE_PARAMS_PER_LAYER = {  # weights and biases of each kind's projections (default options), by hand
    "g1-elementwise": D * H * DH + H * DH,
    "g1-ns-sigmoid": D * H * DH + H * DH,
    "g1-headwise": D * H + H,
    "g1-headshared": D * DH + DH,
    "g1-constant": H * DH,
    "g2-value": D * KV * DH + KV * DH,
    "g5-output": D * D + D,
    "bondarenko": H * (D // H + 1),  # one Linear(d_model / H -> 1) per head
    "hyga": (D * H * DH + H * DH) + H * DH * DH + (H * DH * DH + H * DH) + (H * DH * H + H),  # X, H down, H up, C
}


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_every_gate_kind_builds_with_its_size_and_initial_value(kind):
    """Each kind on tiny-llama: its parameter count, and with its weights zeroed the gate is the constant
    initial value g0 from its bias (HyGA: pi_init x 0.5 from the C-gate), so the model equals its ungated
    twin with every attention output projection scaled by g0."""
    gated = qg.build("tiny-llama", kind, seed=1).eval()
    base = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0).eval())
    gated.load_state_dict(base.state_dict(), strict=False)
    assert sum(p.numel() for p in qg.gate_parameters(gated).values()) == 2 * GATE_PARAMS_PER_LAYER[kind]
    g0 = GATE_KINDS[kind].pi_init * (0.5 if kind == "hyga" else 1.0)
    with torch.no_grad():
        for gate in (m for m in gated.modules() if isinstance(m, Gate)):
            for name, p in gate.named_parameters():
                if not name.endswith(("bias", "logit")):
                    p.zero_()
        for layer in base.model.layers:
            layer.self_attn.o_proj.weight.mul_(g0)
        ids = torch.randint(5, 8192, (2, 11))
        torch.testing.assert_close(gated(ids).logits, base(ids).logits, rtol=1e-4, atol=1e-5)


def test_a_new_gate_kind_is_one_decorated_class(registries):
    """The gate registry: a class decorated with @gate_kind parses, prints, builds into a model, starts at
    its pi_init through its own bias_for, and rotates (it declares its x_readers); nothing else is edited."""
    import math

    import torch

    import quantgate as qg
    from quantgate.attention.gates import Gate, projection, split_heads
    from quantgate.quant.rotate import rotate_
    from quantgate.variants import GATE_KINDS, gate_kind

    registries(GATE_KINDS)  # the registry is as it was after the test

    @gate_kind("tanh-test", "test: (1 + tanh(x W)) / 2 per (head, channel)", pi_init=0.3)
    class TanhGate(Gate):
        x_readers = ("proj",)

        def __init__(self, spec, dims, std):
            super().__init__(spec, dims)
            self.proj = projection(dims.d_model, dims.n_heads * dims.head_dim, spec.low_rank, spec.bias_init, std)

        @classmethod
        def bias_for(cls, pi_init):
            return math.atanh(2 * pi_init - 1)

        def compute(self, x):
            return (1 + torch.tanh(split_heads(self.proj(x), self.dims.n_heads))) / 2

    assert str(AttentionVariant.parse("tanh-test:low_rank=4")) == "tanh-test:low_rank=4"
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", "tanh-test", seed=0).eval())
    gate = model.model.layers[0].self_attn.gate
    assert isinstance(gate, TanhGate)
    with torch.no_grad():
        gate.get_parameter("proj.weight").zero_()
        x = torch.randn(2, 5, model.config.hidden_size)
        torch.testing.assert_close(gate(x), torch.full((2, 4, 5, 16), 0.3))
        ids = torch.randint(0, model.config.vocab_size, (2, 12))
        before = model(input_ids=ids).logits
        rotate_(model)
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
