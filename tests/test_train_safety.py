"""Long unattended training runs: interrupted checkpoint writes, pickle-free resume, the last finite
weights after divergence, resume with changed settings, one writer per run directory."""

import logging
import os
import pathlib
import pickle
import re
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import quantgate as qg
from quantgate.runlock import RunDirectoryBusy, run_lock
from quantgate.train import TrainConfig, TrainingDiverged, train

TINY: dict[str, Any] = {"batch_size": 2, "seq_len": 16, "lr": 3e-3, "eval_data": None, "log_every": 100, "seed": 3}


def _train(out, preset="tiny-llama", **kw):
    model = qg.build(preset, seed=1)
    return train(model, qg.tokenizer(model), config=TrainConfig(out=str(out), **{**TINY, **kw}))


def _assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_an_interrupted_checkpoint_write_is_skipped_and_resume_ends_where_a_straight_run_does(
    tmp_path, monkeypatch, caplog
):
    """Ctrl-C in the middle of writing step-4 (after the weights, before the optimizer state): resume
    goes back to step-2, skipping the leftovers with a warning, and ends bit for bit where an
    uninterrupted run ends."""
    cfg = {"steps": 6, "checkpoint_every": 2}
    straight = _train(tmp_path / "a", **cfg)
    state_dict = torch.optim.AdamW.state_dict

    def interrupted(self):
        if self.state and next(iter(self.state.values()))["step"] == 4:  # the optimizer has made 4 steps
            raise KeyboardInterrupt
        return state_dict(self)

    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "state_dict", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _train(tmp_path / "b", **cfg)
    ckpts = tmp_path / "b" / "checkpoints"
    partial = ckpts / "step-5"  # what an older writer left behind when interrupted
    partial.mkdir()
    shutil.copy(ckpts / "step-2" / "model.safetensors", partial)
    with caplog.at_level(logging.WARNING, logger="quantgate"):
        resumed = _train(tmp_path / "b", resume=True, **cfg)
    _assert_same_weights(straight, resumed)
    assert f"skipping checkpoint {partial}: it has no trainer.json" in caplog.text
    assert f"removing {ckpts / '.step-4.tmp'}: an interrupted write of step-4" in caplog.text
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4", "step-5", "step-6"]


class _Exploit:
    """Unpickling it creates the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_resume_never_unpickles(tmp_path):
    cfg = {"steps": 4, "checkpoint_every": 2}
    _train(tmp_path, stop_after=2, **cfg)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    ckpt = tmp_path / "checkpoints" / "step-2"
    for name in (
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_1.pkl",
        "custom_checkpoint_2.pkl",
        "optimizer.bin",
        "scheduler.bin",
        "random_states_0.pkl",
        "pytorch_model.bin",
        "scaler.pt",
        "model.bin",
    ):
        (ckpt / name).write_bytes(payload)
    _train(tmp_path, resume=True, **cfg)
    assert not marker.exists()
    assert (tmp_path / "model" / "config.json").is_file()


def test_divergence_keeps_the_last_finite_weights(tmp_path):
    """lr 1e6 on tiny-llama: a few steps in, the loss is still finite but its gradient is not; before
    the fix that update made every weight NaN, and last-good-model held them. Now the step stops before
    its update: last-good-model holds the weights after the previous step, as checkpointed then."""
    with pytest.raises(TrainingDiverged) as caught:
        _train(tmp_path, steps=10, checkpoint_every=1, lr=1e6, warmup=0)
    last_good = qg.load(tmp_path / "last-good-model")
    assert all(torch.isfinite(p).all() for p in last_good.parameters())
    found = re.search(r"at step (\d+)", str(caught.value))
    assert found is not None
    step = int(found[1])
    assert step >= 2  # measured: 3
    assert "the gradient norm became non-finite" in str(caught.value)
    assert f"the last finite weights (after step {step - 1}) are in {tmp_path}/last-good-model" in str(caught.value)
    checkpointed = load_file(tmp_path / "checkpoints" / f"step-{step - 1}" / "model.safetensors")
    state = last_good.state_dict()
    assert checkpointed.keys() <= state.keys() and len(checkpointed) >= len(state) - 1  # lm_head is tied
    for name, weight in checkpointed.items():
        assert torch.equal(state[name], weight), name
    assert not (tmp_path / "checkpoints" / f"step-{step}").exists()


def test_resume_refuses_settings_that_change_the_run(tmp_path):
    cfg = {"steps": 4, "checkpoint_every": 2}
    _train(tmp_path, stop_after=2, **cfg)
    with pytest.raises(
        ValueError,
        match=r"step-2 with changed settings: batch_size 2 -> 4, lr 0.003 -> 0.001\. .*"
        r"resume with the saved values, or train into a new --out",
    ):
        _train(tmp_path, resume=True, **{**cfg, "batch_size": 4, "lr": 1e-3})
    with pytest.raises(ValueError, match="changed settings: seq_len 16 -> 32"):
        _train(tmp_path, resume=True, **{**cfg, "seq_len": 32})
    _train(tmp_path, resume=True, steps=4, checkpoint_every=1, log_every=1)  # stop_after 2 -> None: fine
    assert (tmp_path / "model" / "config.json").is_file()


def test_a_second_writer_of_a_run_directory_is_refused(tmp_path):
    # flock is per open file: this process's own train() conflicts with the lock taken here
    with run_lock(tmp_path), pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()}"):
        _train(tmp_path, steps=1)
    assert not (tmp_path / "log.jsonl").exists()


def test_checkpoints_refuse_state_they_cannot_save(tmp_path):
    from accelerate.utils import DistributedType

    from quantgate.train.checkpoint import check_checkpointable

    with pytest.raises(ValueError, match=r"not supported under DEEPSPEED.*use DDP or FSDP version 2"):
        check_checkpointable(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED), [])
    with pytest.raises(ValueError, match="need FSDP version 2"):
        check_checkpointable(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False), [])
    model = qg.build("tiny-llama", seed=1)
    batch = next(iter(qg.data.batches(qg.tokenizer(model), "validation", 16, 2)))
    with pytest.raises(ValueError, match="need data that can resume: list has no state_dict"):
        train(
            model,
            qg.tokenizer(model),
            data=[batch] * 4,
            config=TrainConfig(out=str(tmp_path), steps=4, checkpoint_every=2, **TINY),
        )


def test_a_resumed_log_has_each_step_once(tmp_path):
    """Steps logged after the checkpoint a resume starts from are dropped, then logged again as retrained."""
    import json

    cfg = {"steps": 6, "checkpoint_every": 2, "log_every": 1}
    _train(tmp_path, stop_after=4, **cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")  # killed after logging step 4, before its checkpoint
    with open(tmp_path / "log.jsonl", "a") as fh:
        fh.write('{"event": "train", "step": 5, "lo')  # and in the middle of a record
    _train(tmp_path, resume=True, **cfg)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records[:1]] == ["config"]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_sequences_past_the_position_table_are_refused_before_training(tmp_path):
    model = qg.build("tiny-opt")
    with pytest.raises(ValueError, match="seq_len 2049 is longer than this opt model's 2048 positions"):
        train(model, qg.tokenizer(model), config=TrainConfig(**{**TINY, "seq_len": 2049, "out": str(tmp_path)}))
    assert not any(tmp_path.iterdir())


def test_can_resume_only_from_a_complete_checkpoint(tmp_path):
    from quantgate.train import can_resume

    assert not can_resume(tmp_path)
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)  # interrupted: a study must start afresh
    assert not can_resume(tmp_path)
    _train(tmp_path, steps=4, stop_after=2)
    assert can_resume(tmp_path)
