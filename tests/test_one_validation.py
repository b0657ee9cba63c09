"""One validation for every door: a value the command line refuses, a study file refuses too (and the
Python API: TrainConfig, qg.build), with one line naming the option or field. The ranges have one
definition (quantgate.options, quantgate.train.TRAIN_RANGES, the study schema's sections,
quantgate.models.presets.CONFIG_RANGES), so the doors cannot drift apart."""

import json
from typing import Any

import pytest
import yaml

import quantgate as qg
from quantgate.cli import main
from quantgate.models.families import config_of
from quantgate.study import StudyError, load_study
from quantgate.train import TrainConfig

STUDY = "name: x\nmodels:\n  - name: tiny\n    preset: tiny-llama\n"
TRAIN = ["train", "--preset", "tiny-llama", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]

# (command line, its error, the same value in a study file or None where a study has no such setting,
#  what the study's error says, the TrainConfig field and value the Python API refuses alike or None)
BAD_OPTIONS: dict[str, tuple[list[str], str, str | None, str | None, tuple[str, Any] | None]] = {
    "steps-0": (
        [*TRAIN, "--steps", "0"],
        "--steps must be >= 1; got 0",
        "    train: {steps: 0}\n",
        "steps must be int, >= 1; got 0",
        ("steps", 0),
    ),
    "steps-negative": (
        [*TRAIN, "--steps", "-1"],
        "--steps must be >= 1; got -1",
        "    train: {steps: -1}\n",
        "steps must be int, >= 1; got -1",
        ("steps", -1),
    ),
    "stop-after-0": ([*TRAIN, "--stop-after", "0"], "--stop-after must be >= 1; got 0", None, None, ("stop_after", 0)),
    "warmup": (
        [*TRAIN, "--warmup", "-1"],
        "--warmup must be >= 0; got -1.0",
        "    train: {warmup: -1}\n",
        "warmup must be float, >= 0; got -1",
        ("warmup", -1.0),
    ),
    "eval-every": (
        [*TRAIN, "--eval-every", "-3"],
        "--eval-every must be >= 0; got -3",
        "    train: {eval_every: -3}\n",
        "eval_every must be int, >= 0; got -3",
        ("eval_every", -3),
    ),
    "lr-0": (
        [*TRAIN, "--lr", "0"],
        "--lr must be > 0; got 0.0",
        "    train: {lr: 0}\n",
        "lr must be float | None, > 0; got 0",
        ("lr", 0.0),
    ),
    "lr-nan": (
        [*TRAIN, "--lr", "nan"],
        "--lr must be > 0; got nan",
        "    train: {lr: .nan}\n",
        "lr must be float | None, > 0; got nan",
        ("lr", float("nan")),
    ),
    "lr-inf": (
        [*TRAIN, "--lr", "inf"],
        "--lr must be > 0; got inf",
        "    train: {lr: .inf}\n",
        "lr must be float | None, > 0; got inf",
        ("lr", float("inf")),
    ),
    "checkpoint-every": (
        [*TRAIN, "--checkpoint-every", "-1"],
        "--checkpoint-every must be >= 0; got -1",
        "    train: {checkpoint_every: -1}\n",
        "checkpoint_every must be int, >= 0; got -1",
        ("checkpoint_every", -1),
    ),
    "grad-accum-0": (
        [*TRAIN, "--grad-accum", "0"],
        "--grad-accum must be >= 1; got 0",
        "    train: {grad_accum: 0}\n",
        "grad_accum must be int, >= 1; got 0",
        ("grad_accum", 0),
    ),
    "train-batch-size-0": (
        [*TRAIN, "--batch-size", "0"],
        "--batch-size must be >= 1; got 0",
        "    train: {batch_size: 0}\n",
        "batch_size must be int, >= 1; got 0",
        ("batch_size", 0),
    ),
    "train-seq-len-0": (
        [*TRAIN, "--seq-len", "0"],
        "--seq-len must be >= 1; got 0",
        "    train: {seq_len: 0}\n",
        "seq_len must be int, >= 1; got 0",
        ("seq_len", 0),
    ),
    "seed-negative": (
        [*TRAIN, "--seed", "-1"],
        "--seed must be in [0, 4294967295]; got -1",
        "    train: {seed: -1}\n",
        "seed must be int, in [0, 4294967295]; got -1",
        ("seed", -1),
    ),
    "resume-and-overwrite": (
        [*TRAIN, "--resume", "--overwrite"],
        "--resume continues the run in --out and --overwrite removes it: give one",
        None,
        None,
        None,
    ),
    "eval-batch-size-negative": (
        ["eval", "tiny-llama", "--batch-size", "-1"],
        "--batch-size must be 'auto' or >= 1; got -1",
        "    eval: {batch_size: -1}\n",
        "batch_size must be int | str, 'auto' or >= 1; got -1",
        None,
    ),
    "eval-batch-size-0": (
        ["eval", "tiny-llama", "--batch-size", "0"],
        "--batch-size must be 'auto' or >= 1; got 0",
        "    eval: {batch_size: 0}\n",
        "'auto' or >= 1; got 0",
        None,
    ),
    "eval-batch-size-word": (
        ["eval", "tiny-llama", "--batch-size", "many"],
        "--batch-size must be 'auto' or >= 1; got 'many'",
        "    eval: {batch_size: many}\n",
        "'auto' or >= 1; got 'many'",
        None,
    ),
    "observe-max-batches": (
        ["observe", "tiny-llama", "--max-batches", "-1"],
        "--max-batches must be >= 1; got -1",
        "    observe: {batches: -1}\n",
        "batches must be int, >= 1; got -1",
        None,
    ),
    "observe-batch-size-0": (
        ["observe", "tiny-llama", "--batch-size", "0"],
        "--batch-size must be >= 1; got 0",
        "    observe: {batch_size: 0}\n",
        "batch_size must be int, >= 1; got 0",
        None,
    ),
    "observe-sink-tokens-0": (
        ["observe", "tiny-llama", "--sink-tokens", "0"],
        "--sink-tokens must be >= 1; got 0",
        "    observe: {sink_tokens: 0}\n",
        "sink_tokens must be int, >= 1; got 0",
        None,
    ),
    "observe-sink-tokens-seq-len": (
        ["observe", "tiny-llama", "--sink-tokens", "8", "--seq-len", "8"],
        "--sink-tokens (8) must be fewer than --seq-len (8)",
        "    observe: {sink_tokens: 8, seq_len: 8}\n",
        "sink_tokens (8) must be fewer than observe's seq_len (8)",
        None,
    ),
    "quantize-calib-0": (
        ["quantize", "tiny-llama", "--scheme", "w8a8-int8", "--calib", "0"],
        "--calib must be >= 1; got 0",
        "    calibration: {batches: 0}\n",
        "batches must be int, >= 1; got 0",
        None,
    ),
    "quantize-seq-len-0": (
        ["quantize", "tiny-llama", "--scheme", "w8-int8", "--seq-len", "0"],
        "--seq-len must be >= 1; got 0",
        "    calibration: {seq_len: 0}\n",
        "seq_len must be int, >= 1; got 0",
        None,
    ),
}


@pytest.mark.parametrize("case", BAD_OPTIONS, ids=list(BAD_OPTIONS))
def test_the_command_line_and_a_study_refuse_the_same_values(case, tmp_path, capsys):
    argv, message, study, study_message, api = BAD_OPTIONS[case]
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists() or not any(out.iterdir())  # refused before any work
    if study is not None:
        assert study_message is not None  # a study's setting comes with the error it gives
        f = tmp_path / "study.yaml"
        f.write_text(STUDY + study)
        with pytest.raises(StudyError) as caught:
            load_study(f)
        assert "study.yaml:5: " in str(caught.value) and study_message in str(caught.value), str(caught.value)
    if api is not None:  # the Python API's door: TrainConfig (train() checks it the same way)
        field, value = api
        with pytest.raises(ValueError, match=f"^{field} must be "):
            TrainConfig(**{field: value}).resolved("llama")


def test_the_values_in_range_are_accepted_by_both_doors(tmp_path, capsys):
    """The edges of each range pass: stop_after 1, warmup 0, eval_every 0, checkpoint_every 0, a batch size
    given as a number."""
    out = tmp_path / "run"
    assert (
        main(
            [
                *TRAIN,
                "--steps",
                "1",
                "--stop-after",
                "1",
                "--warmup",
                "0",
                "--eval-every",
                "0",
                "--checkpoint-every",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "model" / "config.json").is_file()
    f = tmp_path / "study.yaml"
    f.write_text(
        STUDY + "    train: {steps: 1, warmup: 0, eval_every: 0, checkpoint_every: 0}\n"
        "    eval: {batch_size: 4}\n    observe: {batches: 1, sink_tokens: 1}\ncalibration: {batches: 1}\n"
    )
    load_study(f)
    TrainConfig(steps=1, stop_after=1, warmup=0, eval_every=0, checkpoint_every=0).resolved("llama")


# (preset, config field, a value out of its range, what every door's error says). The command line gets it as
# --config field=<JSON>, a study file as YAML, qg.build as a keyword
BAD_CONFIGS: dict[str, tuple[str, str, Any, str]] = {
    "hidden-size-63": ("tiny-llama", "hidden_size", 63, "hidden_size 63 is not a multiple of num_attention_heads 4"),
    "heads-3": ("tiny-llama", "num_attention_heads", 3, "hidden_size 64 is not a multiple of num_attention_heads 3"),
    "heads-3-gqa": (
        "tiny-qwen3",
        "num_attention_heads",
        3,
        "num_attention_heads 3 is not a multiple of num_key_value_heads 2",
    ),
    "kv-heads-3": (
        "tiny-llama",
        "num_key_value_heads",
        3,
        "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "rms-norm-eps": ("tiny-llama", "rms_norm_eps", -1, "rms_norm_eps must be > 0; got -1"),
    "rms-norm-eps-nan": ("tiny-llama", "rms_norm_eps", float("nan"), "rms_norm_eps must be > 0; got nan"),
    "layer-norm-eps": ("tiny-bert", "layer_norm_eps", 0, "layer_norm_eps must be > 0; got 0"),
    "hidden-act": ("tiny-llama", "hidden_act", "nonsense", "hidden_act must be one of gelu, "),
    "opt-activation": ("tiny-opt", "activation_function", "nonsense", "activation_function must be one of gelu, "),
    "initializer-range": ("tiny-llama", "initializer_range", 1e30, "initializer_range must be in (0, 1]"),
    "opt-init-std": ("tiny-opt", "init_std", 1e30, "init_std must be in (0, 1]"),
    "layers-0": ("tiny-llama", "num_hidden_layers", 0, "num_hidden_layers must be >= 1; got 0"),
    "layers-negative": ("tiny-llama", "num_hidden_layers", -2, "num_hidden_layers must be >= 1; got -2"),
    "dropout": ("tiny-bert", "hidden_dropout_prob", 1.5, "hidden_dropout_prob must be a probability in [0, 1)"),
    "intermediate-0": ("tiny-llama", "intermediate_size", 0, "intermediate_size must be >= 1; got 0"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_model_config_overrides_are_checked_at_every_door(case, tmp_path, capsys):
    preset, key, value, message = BAD_CONFIGS[case]
    out = tmp_path / "run"
    assert (
        main(["train", "--preset", preset, "--config", f"{key}={json.dumps(value)}", "--steps", "1", "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{preset}: {message}" in err, err
    assert not out.exists()  # refused before anything is written
    f = tmp_path / "study.yaml"
    f.write_text(STUDY.replace("tiny-llama", preset) + "    config:\n      " + yaml.safe_dump({key: value}))
    with pytest.raises(StudyError) as caught:
        load_study(f)
    assert "study.yaml:6: config: " in str(caught.value) and message in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match="^" + preset):
        qg.build(preset, **{key: value})


def test_model_config_overrides_that_fit_are_kept():
    """A head size given explicitly frees hidden_size from the heads (Qwen3), and MLA's latent attention has its
    own head sizes: neither is refused."""
    assert config_of(qg.build("tiny-qwen3", hidden_size=48)).hidden_size == 48
    assert config_of(qg.build("tiny-mla", num_attention_heads=3)).num_attention_heads == 3
    assert config_of(qg.build("tiny-llama", hidden_act="gelu", rms_norm_eps=0.1)).hidden_act == "gelu"


def test_the_python_api_checks_the_same_ranges():
    """qg.evaluate(batch_size=-1) reported word perplexity 1 and qg.observe(max_batches=-1) a raw error: the
    functions behind the CLI refuse what the CLI refuses."""
    model = qg.build("tiny-llama", seed=0)
    tok = qg.tokenizer(model)
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1; got -1$"):
        qg.evaluate(model, tok, ["quantgate_ppl"], batch_size=-1, limit=1)
    with pytest.raises(ValueError, match=r"^max_batches must be >= 1; got -1$"):
        qg.observe(model, qg.data.batches(tok, "validation", seq_len=32, batch_size=2), max_batches=-1)
