import os

# Triton kernels run on the CPU through the interpreter; triton reads this when it is first imported
# (torch and torchao may import it early), so it is set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# a training run of a few seconds (tiny-llama): the settings the training tests share
TINY_TRAIN = {
    "batch_size": 2,
    "seq_len": 16,
    "lr": 3e-3,
    "eval_data": None,
    "log_every": 100,
    "seed": 3,
    "steps": 4,
    "checkpoint_every": 2,
}

# a study of seconds on an untrained tiny-llama, named by .format(name=...)
TINY_STUDY = """name: {name}
models:
  - name: m
    preset: tiny-llama
schemes: [w8-int8]
calibration: {{batches: 1, seq_len: 32, batch_size: 2}}
observe: {{batches: 1, seq_len: 32, batch_size: 2}}
eval: {{tasks: [quantgate_ppl], limit: 1}}
"""


def load_script(path, name: str):
    """A repository script (scripts/, benchmarks/) imported as module ``name``, for tests of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line_error(capsys, command: str) -> str:
    """The command's error: stderr's last line (progress bars may come before it), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"quantgate {command}: error: ")
    return line


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
