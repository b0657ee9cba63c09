"""Training: learning, exact resume, DDP equivalence, gate fine-tuning init, divergence handling."""

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.train import TrainConfig, TrainingDiverged, train

FAST: dict[str, Any] = {"batch_size": 8, "seq_len": 64, "lr": 3e-3, "eval_batches": 2, "log_every": 5}


def _records(out, event):
    return [
        json.loads(line)
        for line in (Path(out) / "log.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == event
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    model = qg.build("tiny-llama", "g1-headwise", seed=0)
    train(
        model, qg.tokenizer(model), config=TrainConfig(steps=40, eval_every=20, observe_every=20, out=str(out), **FAST)
    )
    return model, out


def test_loss_drops_well_below_its_initial_value(trained):
    model, out = trained
    evals = _records(out, "eval")
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["loss"] < 9.01 - 1.5  # from ln(8192) = 9.01 at initialisation
    obs = _records(out, "observe")
    assert len(obs) == 2 and len(obs[0]["layers"]) == 2 and obs[0]["layers"][0]["gate_mean"] is not None
    train_log = _records(out, "train")
    assert train_log[-1]["tokens"] == 40 * 8 * 64 and train_log[-1]["tokens_per_s"] > 0
    assert (out / "training.png").stat().st_size > 0
    again = qg.load(out / "model")
    ids = torch.randint(5, 8192, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("preset, objective_kw", [("tiny-llama", {}), ("tiny-bert", {})])
def test_resume_continues_exactly(tmp_path, preset, objective_kw):
    """N steps straight == N/2, stop, resume, N/2: same weights bit for bit (data position, LR schedule,
    optimizer, RNG and MLM masks restored)."""
    cfg = dict(steps=12, checkpoint_every=6, eval_data=None, seed=3, **FAST)

    def run(out, **kw):
        model = qg.build(preset, seed=1)
        return train(model, qg.tokenizer(model), config=TrainConfig(out=str(out), **{**cfg, **kw}))

    straight = run(tmp_path / "a")
    run(tmp_path / "b", stop_after=6)
    assert not (tmp_path / "b" / "model").exists() and (tmp_path / "b" / "checkpoints" / "step-6").is_dir()
    resumed = run(tmp_path / "b", resume=True)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    lrs_a = [r["lr"] for r in _records(tmp_path / "a", "train")]
    lrs_b = [r["lr"] for r in _records(tmp_path / "b", "train")]
    assert lrs_a == lrs_b


def test_two_process_ddp_matches_one_process(tmp_path, monkeypatch):
    """Same global batch (8 rows): 2 x 4 rows with gloo DDP vs 1 x 8 rows. The gradients are the same
    mean over the same 8 x 32 tokens, summed in a different order, so the weights differ by float32
    rounding amplified by 8 Adam steps, which need not be the same across runs and machines. The criterion:
    the L2 distance between the two runs' weights is below 1e-3 of the distance training moved them
    (measured: 1.2e-7; the max element is no stable measure, as Adam can move a weight whose gradient is
    rounding noise by up to lr). The same DDP run with both processes training on the first 4 rows must
    fail it (measured: 0.5); it trains what one process trains on the first 4 rows of each global batch (each
    rank's gradient is that of those rows, and so is their mean), which is how it runs here, in this process, as
    the one-process run does.
    (accelerate's own ``launch --cpu`` starts several CPU processes only through MPI; torchrun sets
    the same environment and accelerate picks the gloo backend from it.)"""
    import _ddp_train

    from quantgate.train import loop

    one = _ddp_train.trained(8)
    moved = _distance(one, qg.build("tiny-llama", seed=0).state_dict())
    assert moved > 1.0  # training really changed the weights (measured: 8.6 over 0.6 M weights)
    out = tmp_path / "ddp.safetensors"
    script = Path(__file__).with_name("_ddp_train.py")
    subprocess.run([*_two_processes(), str(script), str(out), "4"], check=True, capture_output=True, timeout=600)
    ddp = load_file(out)
    assert _distance(ddp, one) < 1e-3 * moved, _distance(ddp, one) / moved
    shard = loop._shard  # every rank of two takes rank 0's rows
    monkeypatch.setattr(loop, "_shard", lambda batch, rank, world, device: shard(batch, 0, 2, device))
    wrong = _ddp_train.trained(8)
    assert _distance(wrong, one) > 0.1 * moved, _distance(wrong, one) / moved


def _two_processes(*code):
    """A torchrun command line for 2 local processes (gloo on CPU) on a free port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "--no-python",
        sys.executable,
        *code,
    ]


@pytest.mark.slow  # 10 s, two processes twice (the DDP pair stays in the default run)
def test_fsdp_training_resumes_bit_for_bit(tmp_path):
    """FSDP version 2 through accelerate on 2 gloo processes (tests/_fsdp_train.py; accelerate enables FSDP only
    on accelerators, so the helper gives the Accelerator the state an FSDP config gives it on GPUs): 8 steps
    straight equal 4, stop, resume, 4 bit for bit (final model and step-8 checkpoint). The checkpoints are
    safetensors and JSON only and hold whole tensors: the names and shapes of a one-process run's. The sharded
    run trains what one process with the same global batch trains: weights within 1e-3 of the distance training
    moved them, the criterion of the DDP test above (measured: 2.8e-6). Without the optimizer state restored
    the resumed run differs (checked by hand)."""
    subprocess.run(
        [*_two_processes(str(Path(__file__).with_name("_fsdp_train.py")), str(tmp_path))],
        check=True,
        capture_output=True,
        timeout=600,
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for name in (
        "model/model.quantgate.safetensors",  # g1-headwise: a gated model's base weights
        "model/quantgate.safetensors",
        "checkpoints/step-8/model.safetensors",
        "checkpoints/step-8/optimizer.safetensors",
        "checkpoints/step-8/rng-1.safetensors",
    ):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert {p.suffix for p in (resumed / "checkpoints").rglob("*") if p.is_file()} == {".safetensors", ".json"}

    model = qg.build("tiny-llama", "g1-headwise", seed=0)
    train(
        model,
        qg.tokenizer(model),
        config=TrainConfig(
            out=str(tmp_path / "one"),
            steps=8,
            batch_size=8,
            seq_len=32,
            lr=3e-3,
            seed=0,
            log_every=1,
            eval_every=4,
            observe_every=4,
            eval_batches=1,
            checkpoint_every=4,
        ),
    )
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(tmp_path / "one/checkpoints/step-4" / name), load_file(resumed / "checkpoints/step-4" / name)
        assert {k: a[k].shape for k in a} == {k: b[k].shape for k in b}, name
    one = qg.load(tmp_path / "one/model").state_dict()
    sharded = qg.load(straight / "model").state_dict()
    moved = _distance(one, qg.build("tiny-llama", "g1-headwise", seed=0).state_dict())
    assert moved > 1.0 and _distance(sharded, one) < 1e-3 * moved, _distance(sharded, one) / moved


def _distance(a, b):
    return sum(((a[k] - b[k]).double() ** 2).sum() for k in a).sqrt().item()


def test_gate_added_to_a_trained_model_starts_close_to_it(trained, tmp_path):
    model, _ = trained
    plain = qg.build("tiny-llama", seed=0)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".gate." not in k}, strict=False)
    qg.save(plain, tmp_path / "ungated")
    batch = next(iter(qg.data.batches(qg.tokenizer(plain), "validation", 64, 8)))

    def loss(m):
        with torch.no_grad():
            return m(**batch).loss.item()

    base = loss(qg.load(tmp_path / "ungated"))
    finetune = loss(qg.load(tmp_path / "ungated", variant="g1-elementwise:finetune=true"))
    naive = loss(qg.load(tmp_path / "ungated", variant="g1-elementwise"))
    assert abs(finetune - base) < 0.01  # documented init: the gate starts as the identity (+- weights 1e-3)
    assert abs(naive - base) > 10 * abs(finetune - base)  # a plain gate at 0.5 halves every head's output


def test_backcopy_task_trains():
    """40 steps take the held-out loss from uniform over the 8192-token vocabulary to below uniform over
    the task's 512 tokens (measured: 9.02 -> 6.02)."""
    model = qg.build("tiny-llama", seed=0)
    held_out = next(iter(qg.data.batches(qg.tokenizer(model), "backcopy", 64, 8, seed=99)))

    def loss(m):
        with torch.no_grad():
            return m.eval()(**held_out).loss.item()

    before = loss(model)
    after = loss(train(model, qg.tokenizer(model), config=TrainConfig(steps=40, data="backcopy", **FAST)))
    assert before == pytest.approx(math.log(8192), abs=0.05)
    assert after < math.log(512)


def test_divergence_stops_and_names_the_layer(tmp_path):
    """A model that is non-finite from the start has no good state: none is written (finite last-good
    states: tests/test_train_safety.py)."""
    model = cast(LlamaForCausalLM, qg.build("tiny-llama", seed=0))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(
        TrainingDiverged,
        match="step 1; the first non-finite activation is the output of layer 1; "
        "the weights were already non-finite, so no last-good-model",
    ):
        train(model, qg.tokenizer(model), config=TrainConfig(steps=5, out=str(tmp_path), **FAST))
    assert not (tmp_path / "last-good-model").exists()


def test_bad_input(tmp_path):
    model = qg.build("tiny-llama", seed=0)
    tok = qg.tokenizer(model)
    train(model, tok, config=TrainConfig(steps=2, checkpoint_every=2, eval_data=None, out=str(tmp_path / "a"), **FAST))
    other = qg.build("tiny-llama", "g1-headwise", seed=0)
    with pytest.raises(ValueError, match=r"belongs to another model .*variant vanilla.* than this one .*g1-headwise"):
        train(other, tok, config=TrainConfig(steps=4, resume=True, out=str(tmp_path / "a"), **FAST))
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(other, tok, config=TrainConfig(steps=4, resume=True, out=str(tmp_path / "b"), **FAST))
    with pytest.raises(ValueError, match="unknown text source 'wikipedia-2'"):
        train(other, tok, config=TrainConfig(steps=2, data="wikipedia-2", **FAST))
    with pytest.raises(ValueError, match="backcopy task is a causal-LM task"):
        train(qg.build("tiny-bert"), qg.tokenizer("tiny-bert"), config=TrainConfig(steps=2, data="backcopy", **FAST))


def test_masked_only_mlm_loss_equals_the_heads_loss():
    from quantgate.models import family_of

    model = qg.build("tiny-bert", seed=2).eval()
    batch = next(iter(qg.data.batches(qg.tokenizer(model), "validation", 32, 8, "mlm")))
    with torch.no_grad():
        assert family_of(model).masked_lm_loss(model, batch).item() == pytest.approx(
            model(**batch).loss.item(), abs=1e-5
        )


def test_log_with_tensorboard_writes_the_logs_numbers_as_events(tmp_path):
    """``log_with="tensorboard"`` (``--log-with tensorboard``): every number of log.jsonl's train, eval and observe
    records is a TensorBoard scalar at its step, per-layer observe values included; the config is stored too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    out = tmp_path / "run"
    model = qg.build("tiny-llama", "g1-elementwise", seed=0)
    config = TrainConfig(
        steps=4, observe_every=2, eval_every=2, out=str(out), log_with="tensorboard", **{**FAST, "log_every": 1}
    )
    train(model, qg.tokenizer(model), config=config)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    tags = events.Tags()["scalars"]

    def logged(event, key, layer=None):
        rows = [r for r in records if r["event"] == event]
        return [(r["step"], (r["layers"][layer] if layer is not None else r)[key]) for r in rows]

    for event, key, layer, tag in (
        ("train", "loss", None, "train/loss"),
        ("train", "lr", None, "train/lr"),
        ("eval", "loss", None, "eval/loss"),
        ("observe", "sink_mass", None, "observe/sink_mass"),
        ("observe", "gate_mean", 1, "observe/layer_1/gate_mean"),
    ):
        assert tag in tags
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = logged(event, key, layer)
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32 events
    assert list((out / "tensorboard").rglob("hparams.yml"))  # the config, as hyperparameters


def test_log_with_needs_a_run_directory_and_a_known_tracker():
    model = qg.build("tiny-llama", seed=0)
    with pytest.raises(ValueError, match="writes into the run directory: give out"):
        train(model, qg.tokenizer(model), config=TrainConfig(steps=1, log_with="tensorboard", **FAST))
    with pytest.raises(ValueError, match="unknown log_with 'wandb'; valid: tensorboard"):
        train(model, qg.tokenizer(model), config=TrainConfig(steps=1, log_with="wandb", out="x", **FAST))


def test_a_mixed_precision_run_returns_the_model_without_its_autocast_wrapper():
    """train() under bf16 returned the model still wrapped in accelerate's autocast: whatever observed,
    quantized or evaluated it next ran in bf16 without a word."""
    import torch
    from accelerate.state import AcceleratorState

    import quantgate as qg
    from quantgate.train import TrainConfig, train

    model = qg.build("tiny-llama", seed=0)
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=16, mixed_precision="bf16", eval_data=None)
    AcceleratorState._reset_state(True)  # accelerate keeps one precision per process: other tests set none
    try:
        trained = cast(LlamaForCausalLM, train(model, qg.tokenizer(model), config=cfg))
    finally:
        AcceleratorState._reset_state(True)
    seen = []  # the dtype inside the forward pass (the wrapper casts the logits back to float32)
    trained.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with torch.no_grad():
        assert trained(torch.randint(5, 100, (1, 8))).logits.dtype == torch.float32
    assert seen == [torch.float32]


def test_the_log_is_written_and_read_as_typed_records(tmp_path):
    """log.jsonl: one writer (JsonLog, typed events) and one reader (read_log), which refuses an edited line by
    file, line and field."""
    from quantgate.train.checkpoint import ModelIdentity
    from quantgate.train.log import (
        ConfigEvent,
        EvalEvent,
        Event,
        JsonLog,
        LayerPoint,
        ObserveEvent,
        TrainEvent,
        read_log,
    )

    path = tmp_path / "log.jsonl"
    log = JsonLog(path, keep_until=None)
    events: list[Event] = [
        ConfigEvent({"steps": 2}, ModelIdentity("llama", "vanilla", 9, "0123456789abcdef"), 1),
        TrainEvent(1, 5.5, 1e-3, None, 64, 1000.0),
        EvalEvent(1, 5.25),
        ObserveEvent(1, [LayerPoint(3.0, 1.5, 0.2, None)], 3.0, 10.0, 1.5, 0.2, None),
    ]
    for e in events:
        log.write(e)
    assert read_log(path) == events
    lines = path.read_text().splitlines()
    lines[3] = lines[3].replace('"sink_mass": 0.2', '"sink_mass": 5')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(qg.InputError, match=r"log\.jsonl: line 4: .*sink_mass is 5, not a finite number in \[0, 1\]"):
        read_log(path)
    path.write_text(lines[0] + '\n{"event": "lunch", "step": 1}\n')
    with pytest.raises(qg.InputError, match="line 2 is not a log record"):
        read_log(path)
