import os

# Triton kernels run on the CPU through the interpreter; triton reads this when it is first imported
# (torch and torchao may import it early), so it is set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


FAMILY_PRESETS = ["tiny-bert", "tiny-opt", "tiny-llama", "tiny-qwen3", "tiny-qwen2"]
GATED = ["g1-elementwise", "g1-headwise", "g1-headshared", "g1-constant", "g1-ns-sigmoid", "g2-value",
         "g5-output", "bondarenko", "bondarenko:mode=mlp", "bondarenko:mode=all-heads", "hyga",
         "hyga:low_rank=4,fusion=product,c_gate=false"]
ALL_VARIANTS = ["vanilla", "clipped", "clipped:alpha=2", "sink", *GATED, "g1-headwise+clipped+sink",
                "hyga:low_rank=4+sink"]
