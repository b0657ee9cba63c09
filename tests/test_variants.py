import math

import pytest

from quantgate.variants import GATE_KINDS, AttentionVariant, ClipSpec, GateSpec, SinkSpec

from conftest import ALL_VARIANTS

TEXTS = ALL_VARIANTS + [
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
    assert AttentionVariant.parse("clipped").clip.params(7) == (-0.025, 1.0)
    assert AttentionVariant.parse("bondarenko").gate.pi_init == 0.25
    g = AttentionVariant.parse("g1-headwise:pi_init=0.25").gate
    assert g.bias_init == pytest.approx(math.log(0.25 / 0.75))
    ns = AttentionVariant.parse("g1-ns-sigmoid:pi_init=0.9").gate  # 0.5 + 0.5 * sigmoid(b) = 0.9
    assert 0.5 + 0.5 / (1 + math.exp(-ns.bias_init)) == pytest.approx(0.9)


@pytest.mark.parametrize("text, fragment", [
    ("g9-magic", "valid: vanilla, g1-elementwise"),
    ("g1-elementwise:mode=mlp", "valid: pi_init, low_rank"),
    ("g1-constant:low_rank=4", "low_rank"),
    ("bondarenko:mode=deep", "mode must be one of"),
    ("hyga:fusion=max", "fusion must be one of"),
    ("g1-headwise:pi_init=1.5", "pi_init must lie in"),
    ("g1-ns-sigmoid:pi_init=0.3", "pi_init must lie in (0.5, 1)"),
    ("clipped:gamma=0.1", "gamma must be <= 0"),
    ("clipped:gamma=-0.1,alpha=2", "exactly one of gamma"),
    ("g1-headwise+g2-value", "more than one gate"),
    ("vanilla+sink", "combines with nothing"),
    ("sink:init=abc", "init expects float"),
    ("hyga:c_gate=maybe", "c_gate expects bool"),
])
def test_bad_variants_name_the_problem(text, fragment):
    with pytest.raises(ValueError) as err:
        AttentionVariant.parse(text)
    assert fragment in str(err.value)


def test_every_gate_kind_is_buildable():
    from quantgate.attention.gates import _GATES

    assert set(_GATES) == set(GATE_KINDS)
