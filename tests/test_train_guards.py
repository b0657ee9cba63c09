"""What a training run reads back and where it writes: every field of a checkpoint's trainer.json (and its
other files) is checked before a resume uses it, a resume continues only the run its model and config
describe, a fresh run never lands among another run's files, and a quantized model is not trained."""

import importlib
import json
import shutil
import time
from typing import Any

import pytest
from conftest import TINY_TRAIN
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import quantgate as qg
from quantgate.cli import main
from quantgate.train import TrainConfig, train

# the modules (quantgate.train is qg.train, the function, as an attribute of quantgate)
train_checkpoint, train_log, train_rng = (
    importlib.import_module(f"quantgate.train.{m}") for m in ("checkpoint", "log", "rng")
)
TINY: dict[str, Any] = TINY_TRAIN
STEP = "checkpoints/step-2"


def _train(out, config=None, **kw):
    model = qg.build("tiny-llama", seed=1, **(config or {}))
    return train(model, qg.tokenizer(model), config=TrainConfig(out=str(out), **{**TINY, **kw}))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped at step 2 of 4 (checkpointed there), copied by each test before it edits it."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    _train(out, stop_after=2)
    return out


def _copy(stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    return run


def _edit_trainer(run, edit):
    f = run / STEP / "trainer.json"
    saved = json.loads(f.read_text())
    edit(saved)
    f.write_text(json.dumps(saved))


def _group_lr(saved):
    saved["optimizer"]["param_groups"][0]["lr"] = 1e6


def _drop(*path):
    def edit(saved):
        d = saved
        for p in path[:-1]:
            d = d[p]
        del d[path[-1]]

    return edit


def _set(value, *path):
    def edit(saved):
        d = saved
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value

    return edit


# (edit of the checkpoint's trainer.json, what the refusal names). A field a resume reads that is missing,
# of another type or out of range makes the checkpoint unusable (skipped with a warning, so "nothing to resume"
# names it); hyperparameters that do not follow from the run's config are refused as another run's.
TAMPERED = {
    "optimizer-lr": (_group_lr, "optimizer.param_groups[0].lr is 1000000.0, but the run's config makes it"),
    "optimizer-weight-decay": (
        _set(0.5, "optimizer", "param_groups", 0, "weight_decay"),
        "optimizer.param_groups[0].weight_decay is 0.5, but the run's config makes it 0.1",
    ),
    "optimizer-betas": (
        _set([0.5, 0.5], "optimizer", "param_groups", 1, "betas"),
        "optimizer.param_groups[1].betas is [0.5, 0.5]",
    ),
    "optimizer-initial-lr": (
        _set(1.0, "optimizer", "param_groups", 0, "initial_lr"),
        "optimizer.param_groups[0].initial_lr is 1.0",
    ),
    "optimizer-groups": (lambda s: s["optimizer"]["param_groups"].pop(), "optimizer.param_groups holds 1 groups"),
    "scheduler-base-lrs": (_set([1e6, 1e6], "scheduler", "base_lrs"), "scheduler.base_lrs is [1000000.0, 1000000.0]"),
    "scheduler-epoch": (
        _set(0, "scheduler", "last_epoch"),
        "scheduler.last_epoch is 0, but the run's config makes it 2",
    ),
    "world-size-huge": (
        _set(10_000_000, "world_size"),
        "world_size is 10000000, but the checkpoint holds the RNG states of 1 processes",
    ),
    "world-size-missing": (_drop("world_size"), "trainer.json: world_size is missing"),
    "world-size-text": (_set("1", "world_size"), "world_size is '1', not a whole number >= 1"),
    "world-size-0": (_set(0, "world_size"), "world_size is 0, not a whole number >= 1"),
    "step-negative": (_set(-1, "progress", "step"), "progress.step is -1, not a whole number >= 0"),
    "tokens-missing": (_drop("progress", "tokens"), "trainer.json: progress.tokens is missing"),
    "identity-missing": (_drop("identity", "family"), "trainer.json: identity.family is missing"),
    "groups-not-objects": (
        _set([1, 2], "optimizer", "param_groups"),
        "optimizer.param_groups[0] is a JSON number, not an object",
    ),
    "scaler-text": (_set("x", "scaler"), "scaler is a JSON string, not an object"),
    "data-batch": (_set("x", "data", "batch"), "data.batch is 'x', not a whole number >= 0"),
    "model-config": (_set([], "model_config"), "model_config is a JSON array, not an object"),
    "not-an-object": (lambda s: s.clear() or s.update(format=1, world_size=[]), "trainer.json: identity is missing"),
}


@pytest.mark.parametrize("case", TAMPERED, ids=list(TAMPERED))
def test_a_tampered_trainer_json_is_refused_naming_its_file_and_field(case, stopped, tmp_path):
    edit, message = TAMPERED[case]
    run = _copy(stopped, tmp_path)
    _edit_trainer(run, edit)
    started = time.perf_counter()
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        _train(run, resume=True)
    assert time.perf_counter() - started < 60  # world_size 10 000 000 took 81 s and 2.7 GB before
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    assert f"{run / STEP}" in text  # the checkpoint, and so its trainer.json, is named
    assert not (run / "model").exists()


# (what is changed in the run's files, what the refusal says)
def _truncate(run):
    f = run / STEP / "trainer.json"
    f.write_text(f.read_text()[:100])


def _bad_rng(run):
    f = run / STEP / "rng-0.safetensors"
    save_file(load_file(f), f, metadata={"python": "[1, 2]", "numpy": "x"})


def _bad_optimizer_key(run):
    f = run / STEP / "optimizer.safetensors"
    tensors = load_file(f)
    tensors["999.exp_avg"] = next(iter(tensors.values())).clone()
    save_file(tensors, f)


def _bad_optimizer_shape(run):
    f = run / STEP / "optimizer.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if k.endswith("exp_avg"))
    tensors[key] = tensors[key].flatten()[:3].clone()
    save_file(tensors, f)


BROKEN_FILES = {
    "trainer-truncated": (_truncate, "skipped step-2: cannot read "),  # read_json names the file and why
    "rng-metadata": (_bad_rng, "rng-0.safetensors: not the RNG states this trainer saves"),
    "optimizer-key": (_bad_optimizer_key, "tensor '999.exp_avg' is not '<parameter index>.<AdamW state>'"),
    "optimizer-shape": (_bad_optimizer_shape, "has shape [3]; its parameter needs"),
}


@pytest.mark.parametrize("case", BROKEN_FILES, ids=list(BROKEN_FILES))
def test_a_broken_run_file_is_refused_naming_it(case, stopped, tmp_path):
    breaks, message = BROKEN_FILES[case]
    run = _copy(stopped, tmp_path)
    breaks(run)
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        _train(run, resume=True)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    assert f"{run / STEP}/" in str(caught.value)  # the file is named


def _bug(*args, **kwargs):
    raise ValueError("a bug in the reader")


def test_a_bug_reading_a_checkpoint_or_log_is_raised_not_taken_for_a_broken_file(tmp_path, monkeypatch):
    """A checkpoint without a readable trainer.json is skipped and a log line that is no record refused, each in one
    line; a plain ValueError from the code reading them is a bug: it propagates, and no checkpoint is skipped."""
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"skipped step-1: it has no trainer\.json"):
        train_checkpoint.newest_checkpoint(tmp_path)
    monkeypatch.setattr(train_checkpoint, "_read_trainer", _bug)
    with pytest.raises(ValueError, match="a bug in the reader"):
        train_checkpoint.newest_checkpoint(tmp_path)
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"event": "eval", "step": 1}) + "\n")
    with pytest.raises(qg.InputError, match=r"log\.jsonl: line 1: loss is missing"):
        train_log.read_log(log)
    monkeypatch.setattr(train_log.EvalEvent, "from_json", classmethod(_bug))
    with pytest.raises(ValueError, match="a bug in the reader"):
        train_log.read_log(log)


def test_rng_states_that_do_not_load_are_refused_naming_the_file_and_a_bug_is_raised(tmp_path, monkeypatch):
    f = tmp_path / "rng-0.safetensors"
    train_rng.save_rng(f)
    train_rng.load_rng(f)  # its own states load
    tensors, metadata = load_file(f), train_rng.GeneratorStates.from_json(safe_open(str(f), "pt").metadata())
    for broken, why in [
        ({"python": metadata.python, "numpy": "x"}, "its numpy state: Expecting value"),
        ({"python": "[1, 2]", "numpy": metadata.numpy}, "its python state is not an array of 3 items"),
        ({"python": "[3, 2, null]", "numpy": metadata.numpy}, "TypeError"),  # python's setstate refuses it
        ({"python": metadata.python}, "its metadata: numpy is missing"),
    ]:
        save_file(tensors, f, metadata=broken)
        with pytest.raises(qg.InputError, match=rf"rng-0\.safetensors: not the RNG states this trainer saves.*{why}"):
            train_rng.load_rng(f)
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(qg.InputError, match=r"cannot read .*rng-0\.safetensors: .* corrupt or truncated"):
        train_rng.load_rng(f)
    train_rng.save_rng(f)
    monkeypatch.setattr(train_rng.GeneratorStates, "from_json", classmethod(_bug))
    with pytest.raises(ValueError, match="a bug in the reader") as caught:
        train_rng.load_rng(f)
    assert not isinstance(caught.value, qg.QuantgateError)


def test_a_log_line_that_is_not_a_record_does_not_stop_a_resume(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    with open(run / "log.jsonl", "a") as fh:
        fh.write("[1]\nnull\n")
    _train(run, resume=True)
    assert (run / "model" / "config.json").is_file()
    assert "[1]" not in (run / "log.jsonl").read_text()


@pytest.mark.parametrize(
    "config, changed",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'silu' -> 'gelu'"),
        ({"rms_norm_eps": 0.1}, "rms_norm_eps 1e-06 -> 0.1"),
    ],
)
def test_resume_refuses_a_model_config_that_changed_though_the_shapes_agree(config, changed, stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    with pytest.raises(ValueError, match="the model's config changed: " + changed.replace("(", r"\(")) as caught:
        _train(run, config=config, resume=True)
    assert "resume with the same model and --config" in str(caught.value)
    _train(run, resume=True)  # the same config continues
    assert (run / "model" / "config.json").is_file()


def test_resume_refuses_a_stop_the_run_has_passed(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    with pytest.raises(ValueError, match=r"stop_after 2: .*step-2 is at step 2 already; give a later stop_after"):
        _train(run, resume=True, stop_after=2)


def test_a_fresh_run_is_refused_among_another_runs_files(stopped, tmp_path, capsys):
    """Before: a second run without --resume replaced model/ and log.jsonl but kept the first run's
    checkpoints, which a later --resume continued."""
    run = _copy(stopped, tmp_path)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(
        ValueError,
        match=r"holds another training run \(log\.jsonl, checkpoints\): continue it "
        r"with resume=True \(--resume\), start afresh with overwrite=True",
    ):
        _train(run, seed=4)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing touched
    argv = [
        "train",
        "--preset",
        "tiny-llama",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(run),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "--resume" in err
    assert main([*argv, "--overwrite"]) == 0  # removes the earlier run first
    assert not (run / "checkpoints").exists() and (run / "model" / "config.json").is_file()
    assert json.loads((run / "log.jsonl").read_text().splitlines()[0])["config"]["steps"] == 2


def test_stop_after_says_what_it_wrote_and_resume_finishes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny-llama",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
    ]
    assert main([*argv, "--stop-after", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"stopped at step 2: wrote {out}/checkpoints/step-2" in printed and "continue with --resume" in printed
    assert "model" not in printed and not (out / "model").exists()
    assert main([*argv, "--resume"]) == 0
    assert f"wrote {out}/model" in capsys.readouterr().out and (out / "model" / "config.json").is_file()


def test_a_quantized_model_is_not_trained(tmp_path, capsys):
    model = qg.build("tiny-llama", seed=1)
    q = qg.quantize(model, "w8-int8")
    with pytest.raises(
        ValueError,
        match=r"this model is quantized \(w8-int8\); training would update rounded "
        r"weights .* train the float model",
    ):
        train(q, qg.tokenizer(model), config=TrainConfig(**{**TINY, "steps": 1}))
    qg.save(q, tmp_path / "q")
    assert main(["train", "--model", str(tmp_path / "q"), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this model is quantized (w8-int8)" in err
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_overwrite_does_not_remove_the_model_it_trains(tmp_path):
    """`train --model OUT/last-good-model --out OUT --overwrite` (continuing a diverged run's last finite weights)
    would delete its own input: refused."""
    run = tmp_path / "run"
    _train(run, steps=2, checkpoint_every=0)
    model = qg.load(run / "model")
    with pytest.raises(ValueError, match=r"overwrite would remove .*run/model, which holds the model being trained"):
        train(model, qg.tokenizer(model), config=TrainConfig(out=str(run), overwrite=True, **{**TINY, "steps": 1}))
    assert (run / "model" / "config.json").is_file()


def test_every_family_names_its_training_recipe():
    """A family trains with its own recipe or an explicit one (the causal families without a paper recipe take
    OPT's, listed by name); a family with none is refused unless every value is given."""
    from quantgate.models.families import BERT_RECIPE, FAMILIES, OPT_RECIPE

    assert all(f.recipe is not None for f in FAMILIES.values())  # a field of the family's row
    assert FAMILIES["bert"].recipe is BERT_RECIPE and FAMILIES["llama"].recipe is OPT_RECIPE
    with pytest.raises(ValueError, match=r"family 'gpt9' has no training recipe: give lr, betas"):
        TrainConfig(weight_decay=0.0, schedule="constant").resolved("gpt9")
    given = TrainConfig(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, schedule="constant").resolved("gpt9")
    assert (given.lr, given.betas, given.weight_decay, given.schedule) == (1e-3, (0.9, 0.99), 0.0, "constant")
