import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


FAMILY_PRESETS = ["tiny-bert", "tiny-opt", "tiny-llama", "tiny-qwen3", "tiny-qwen2"]
GATED = ["g1-elementwise", "g1-headwise", "g1-headshared", "g1-constant", "g1-ns-sigmoid", "g2-value",
         "g5-output", "bondarenko", "bondarenko:mode=mlp", "bondarenko:mode=all-heads", "hyga",
         "hyga:low_rank=4,fusion=product,c_gate=false"]
ALL_VARIANTS = ["vanilla", "clipped", "clipped:alpha=2", "sink", *GATED, "g1-headwise+clipped+sink",
                "hyga:low_rank=4+sink"]
