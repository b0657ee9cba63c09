import os

# Triton kernels run on the CPU through the interpreter; triton reads this when it is first imported
# (torch and torchao may import it early), so it is set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


FAMILY_PRESETS = ["tiny-bert", "tiny-opt", "tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mla"]


def build_or_refuse(preset, variant, **kw):
    """qg.build, except where the family cannot express the variant (MLA and G2): then the refusal is
    checked and None returned."""
    import quantgate as qg

    if preset == "tiny-mla" and "g2-value" in variant:
        with pytest.raises(ValueError, match="g2-value gates each key token's values"):
            qg.build(preset, variant, **kw)
        return None
    return qg.build(preset, variant, **kw)


GATED = [
    "g1-elementwise",
    "g1-headwise",
    "g1-headshared",
    "g1-constant",
    "g1-ns-sigmoid",
    "g2-value",
    "g5-output",
    "bondarenko",
    "bondarenko:mode=mlp",
    "bondarenko:mode=all-heads",
    "hyga",
    "hyga:low_rank=4,fusion=product,c_gate=false",
]
ALL_VARIANTS = [
    "vanilla",
    "clipped",
    "clipped:alpha=2",
    "sink",
    *GATED,
    "g1-headwise+clipped+sink",
    "hyga:low_rank=4+sink",
]
