"""Helper for tests/test_train.py: one training run, launched with or without accelerate."""

import sys

import quantgate as qg
from quantgate.train import TrainConfig, train

out, per_device = sys.argv[1], int(sys.argv[2])
model = qg.build("tiny-llama", seed=0)
model = train(
    model,
    qg.tokenizer(model),
    config=TrainConfig(steps=8, batch_size=per_device, seq_len=32, lr=3e-3, eval_data=None, seed=0, log_every=1),
)
from accelerate import PartialState  # noqa: E402

if PartialState().is_main_process:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, out)
