"""Helper for tests/test_train.py and benchmarks/gpu_check.py: FSDP version 2 training through accelerate,
straight (into OUT/straight) and stopped at step 4 and resumed (into OUT/resumed).

On GPUs, launch it with accelerate's FSDP config (``accelerate launch --use_fsdp --fsdp_version 2``, or its
environment under torchrun), deterministic kernels on. On CPUs accelerate turns FSDP on for no config (CPU
processes stay MULTI_CPU), so here the Accelerator is given the state an FSDP config gives it on GPUs
(distributed type FSDP, the plugin): accelerate's own FSDP2 preparation (fully_shard per decoder layer, the
optimizer switched to the sharded parameters) and quantgate's checkpoints then run on real DTensor shards over
gloo."""

import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType

import quantgate as qg
from quantgate.train import TrainConfig, loop  # loop: train() makes its Accelerator there


class FsdpOnCpu(Accelerator):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state.distributed_type = DistributedType.FSDP  # as AcceleratorState sets both on GPUs
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )


if torch.cuda.is_available():
    torch.use_deterministic_algorithms(True, warn_only=True)  # the runs are compared bit for bit
else:
    loop.Accelerator = FsdpOnCpu
out = Path(sys.argv[1])
settings = {
    "steps": 8,
    "batch_size": 4,
    "seq_len": 32,
    "lr": 3e-3,
    "seed": 0,
    "log_every": 1,
    "eval_every": 4,
    "observe_every": 4,
    "eval_batches": 1,
    "checkpoint_every": 4,
    "mixed_precision": "no",
}


def run(name, **kw):
    model = qg.build("tiny-llama", "g1-headwise", seed=0)
    qg.train(model, qg.tokenizer(model), config=TrainConfig(out=str(out / name), **{**settings, **kw}))
    assert loop.Accelerator().is_fsdp2, "the run was not sharded: launch with accelerate's FSDP version 2 config"


run("straight")
run("resumed", stop_after=4)
run("resumed", resume=True)
