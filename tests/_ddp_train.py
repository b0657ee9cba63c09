"""Helper for tests/test_train.py: one training run, launched with or without accelerate (``python _ddp_train.py
OUT ROWS_PER_PROCESS``), or in the test's own process (:func:`trained`)."""

import sys

import torch

import quantgate as qg
from quantgate.train import TrainConfig, train


def trained(per_device: int) -> dict[str, torch.Tensor]:
    """The weights after 8 steps of ``per_device`` rows in each process (the tied head left out)."""
    model = qg.build("tiny-llama", seed=0)
    model = train(
        model,
        qg.tokenizer(model),
        config=TrainConfig(steps=8, batch_size=per_device, seq_len=32, lr=3e-3, eval_data=None, seed=0, log_every=1),
    )
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


if __name__ == "__main__":
    out, per_device = sys.argv[1], int(sys.argv[2])
    weights = trained(per_device)
    from accelerate import PartialState

    if PartialState().is_main_process:
        from safetensors.torch import save_file

        save_file(weights, out)
