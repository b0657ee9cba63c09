"""A study that a run would reject is rejected by the dry run, naming the YAML line and the key; the
default study ships in the package; one study run writes a run directory at a time."""

import os
from pathlib import Path

import pytest

from quantgate.errors import InputError, QuantgateError
from quantgate.models.families import Family
from quantgate.models.io import Placement
from quantgate.runlock import RunDirectoryBusy, run_lock
from quantgate.study import StudyError, load_study, plan, run_study, schema
from quantgate.train import TrainConfig
from quantgate.variants import AttentionVariant

ROOT = Path(__file__).resolve().parents[1]
TINY = "name: x\nmodels:\n  - name: tiny\n    preset: tiny-llama\n"

# (study text, line of the error, what the message names)
BAD = {
    "steps-text": (TINY + "    train: {steps: ten}\n", 5, "steps must be int, >= 1; got 'ten'"),
    "steps-negative": (TINY + "    train:\n      steps: -3\n", 6, "steps must be int, >= 1; got -3"),
    "lr-text": (TINY + "    train:\n      steps: 4\n      lr: fast\n", 7, "lr must be float | None, > 0; got 'fast'"),
    "lr-1e-3": (TINY + "    train: {lr: 1e-3}\n", 5, "got '1e-3' (YAML reads 1e-3 as text; write 0.001)"),
    "betas": (TINY + "    train: {betas: [0.9, 1.0]}\n", 5, "betas must be tuple[float, float] | None, each in [0, 1)"),
    "min-lr-ratio": (TINY + "    train: {min_lr_ratio: 1.5}\n", 5, "min_lr_ratio must be float, in [0, 1]"),
    "eval-every": (TINY + "    train: {eval_every: -1}\n", 5, "eval_every must be int, >= 0"),
    "schedule": (TINY + "    train: {steps: 2,\n            schedule: cosinus}\n", 6, "unknown schedule 'cosinus'"),
    "mixed-precision": (TINY + "    train: {mixed_precision: bf17}\n", 5, "mixed_precision must be one of auto, no"),
    "eval-data": (TINY + "    train: {eval_data: validaton}\n", 5, "unknown data source 'validaton'"),
    "hf-source": (TINY + "calibration: {data: 'hf:wikitext'}\n", 5, "hf sources are hf:<dataset>"),
    "backcopy-mlm": (
        "name: x\nmodels:\n  - preset: tiny-bert\n    train: {data: backcopy}\n",
        4,
        "data source 'backcopy' is a causal-LM task",
    ),
    "backcopy-option": (
        TINY + "    train: {data: 'backcopy:start=sideways'}\n",
        5,
        "backcopy: start must be one of random, chain, got 'sideways'",
    ),
    "calibration-backcopy-option": (
        TINY + "calibration: {data: 'backcopy:trigger=0.1'}\n",
        5,
        "backcopy: unknown option 'trigger=0.1'",
    ),
    "sink-tokens-0": (TINY + "observe: {sink_tokens: 0}\n", 5, "sink_tokens must be int, >= 1; got 0"),
    "sink-tokens-all": (
        TINY + "    observe: {seq_len: 16, sink_tokens: 16}\n",
        5,
        "sink_tokens (16) must be fewer than observe's seq_len (16)",
    ),
    "calibration-batches": (TINY + "calibration:\n  batches: 0\n", 6, "batches must be int, >= 1; got 0"),
    "report-pair": (TINY + "report:\n  pairs: [[tiny, tiny-g1]]\n", 6, "names 'tiny-g1', not a model of this study"),
    "report-baseline": (
        TINY + "report:\n  baseline: g1-elementwise\n",
        6,
        "baseline 'g1-elementwise' is not a variant of any model; variants: vanilla",
    ),
    "report-fixes-scheme": (
        TINY + "schemes: [w8a8-int8-static]\nreport:\n  fixes: {reference: w8a8-int8-dynamic}\n",
        7,
        "reference 'w8a8-int8-dynamic' is not a scheme of this study; schemes: w8a8-int8-static",
    ),
    "report-fixes-within": (
        TINY + "schemes: [w8a8-int8-static]\nreport:\n  fixes: {reference: w8a8-int8-static, within: 5}\n",
        7,
        "within must be a fraction in (0, 1) (0.01: within 1% of float), got 5",
    ),
    "report-fixes-key": (
        TINY + "schemes: [w8a8-int8-static]\nreport:\n  fixes: {reference: w8a8-int8-static, target: 1}\n",
        7,
        "unknown key(s) target; valid: reference, within",
    ),
    "model-calibration-batches": (TINY + "    calibration: {batches: 0}\n", 5, "batches must be int, >= 1; got 0"),
    "model-calibration-backcopy-mlm": (
        "name: x\nmodels:\n  - preset: tiny-bert\n    calibration: {data: backcopy}\n",
        4,
        "data source 'backcopy' is a causal-LM task",
    ),
    "eval-limit": (
        TINY + "eval:\n  limit: 0\n",
        6,
        "limit must be a number of documents (>= 1) or a fraction in (0, 1), got 0",
    ),
    "eval-limit-fraction": (
        TINY + "eval:\n  limit: 2.5\n",
        6,
        "limit 2.5 is neither a whole number of documents nor a fraction below 1",
    ),
    "eval-limit-task": (
        TINY + "eval:\n  tasks: [quantgate_ppl]\n  limit: {quantgate_pl: 2}\n",
        7,
        "limit names 'quantgate_pl', not among the evaluated tasks",
    ),
    "eval-batch-size": (TINY + "    eval: {batch_size: big}\n", 5, "batch_size must be int | str, 'auto' or >= 1"),
    "eval-max-length": (TINY + "    eval: {max_length: 0}\n", 5, "max_length must be int, >= 1; got 0"),
    "seed": (TINY + "seed: abc\n", 5, "seed must be int, in [0, 4294967295]; got 'abc'"),
    "g2-value-on-mla": (
        "name: x\nmodels:\n  - preset: tiny-mla\n    variants: [vanilla, g2-value]\n",
        4,
        "variant 'g2-value': mla: g2-value gates each key token's values",
    ),
    "vanilla-qwen3-next": (
        "name: x\nmodels:\n  - preset: tiny-qwen3-next\n",
        3,
        "variant 'vanilla': qwen3-next has a built-in g1-elementwise gate",
    ),
    "train-seq-len-opt": (
        "name: x\nmodels:\n  - preset: tiny-opt\n    train: {steps: 2, seq_len: 4096}\n",
        4,
        "train seq_len: seq_len 4096 is longer than this opt model's 2048 positions",
    ),
    "observe-seq-len-opt": (
        "name: x\nmodels:\n  - preset: tiny-opt\nobserve:\n  seq_len: 4096\n",
        5,
        "observe seq_len: seq_len 4096 is longer than this opt model's 2048 positions",
    ),
    "positions-override": (
        "name: x\nmodels:\n  - preset: tiny-opt\n    config: {max_position_embeddings: 64}\n",
        3,
        "observe seq_len: seq_len 128 is longer than this opt model's 64 positions",
    ),
    "config-unknown-key": (
        TINY + "    config: {num_hidden_layer: 4}\n",
        5,
        "'num_hidden_layer' is not a LlamaConfig field (training settings",
    ),
    "config-type": (
        TINY + "    config:\n      num_hidden_layers: four\n",
        6,
        "config: tiny-llama: num_hidden_layers expects int (default 2), got 'four'",
    ),
    "load-missing": ("name: x\nmodels:\n  - load: ./no-such-model\n", 3, "cannot load './no-such-model'"),
    "name-separator": (
        "name: x\nmodels:\n  - name: a/b\n    preset: tiny-llama\n",
        3,
        "name must be str, without / or \\, not '.' or '..', at most 255 bytes (it names a folder); got 'a/b'",
    ),
    "placement": (
        "name: x\nmodels:\n  - load: smollm2-135m\n    placement: {device_map: everywhere}\n",
        4,
        "device_map 'everywhere': one of auto",
    ),
    "yaml-date": (TINY + "description: 2020-13-45\n", 5, "'2020-13-45' is no timestamp (month must be in 1..12)"),
    "yaml-int-tag": (TINY + "seed: !!int abc\n", 5, "'abc' is no int (invalid literal for int()"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_dry_run_rejects_what_a_run_would(case, tmp_path):
    text, line, message = BAD[case]
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(StudyError) as err:
        load_study(f)  # what --dry-run runs first
    assert f"bad.yaml:{line}: " in str(err.value) and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def _bug(*args, **kwargs):
    raise ValueError("a bug below the check")


LOADED = "name: x\nmodels:\n  - load: twin-vanilla\n"
# a function a study file's check calls, where a plain ValueError is a bug (each check refuses the user's input
# with an InputError): (its owner, its name, a study that reaches the call)
BUGS = {
    "read_yaml": (schema, "read_yaml", TINY),
    "Placement": (Placement, "__post_init__", LOADED + "    placement: {device_map: auto}\n"),
    "batch_count": (schema, "batch_count", TINY),
    "TrainConfig.resolved": (TrainConfig, "resolved", TINY + "    train: {steps: 2}\n"),
    "AttentionVariant.parse": (AttentionVariant, "parse", TINY),
    "check_expressible": (schema, "check_expressible", TINY + "    variants: [g1-elementwise]\n"),
    "expand_scheme": (schema, "expand_scheme", TINY + "schemes: [w8a8-int8-static]\n"),
    "get_scheme": (
        schema,
        "get_scheme",
        TINY + "schemes: [w8a8-int8-static]\nreport:\n  fixes: {reference: w8a8-int8-static}\n",
    ),
    "check_limit": (schema, "check_limit", TINY),
    "task_options": (schema, "task_options", TINY + "calibration: {data: backcopy}\n"),
    "hf_spec": (schema, "hf_spec", TINY + "calibration: {data: 'hf:wikitext:train'}\n"),
    "preset_config": (schema, "preset_config", TINY),
    "read_config": (schema, "read_config", LOADED),
    "family_of": (schema, "family_of", LOADED),
    "check_seq_len": (Family, "check_seq_len", TINY),
}


@pytest.mark.parametrize("case", BUGS, ids=list(BUGS))
def test_a_bug_below_a_check_is_not_reported_as_the_study_files_fault(case, tmp_path, monkeypatch):
    """Each check of a study file catches the typed refusal of what it calls (InputError), not any ValueError: a
    programming error under it keeps its traceback instead of reading as a bad line of the file."""
    owner, name, text = BUGS[case]
    monkeypatch.setattr(owner, name, _bug)
    f = tmp_path / "s.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match="a bug below the check") as err:
        load_study(f)
    assert not isinstance(err.value, QuantgateError)


def test_data_a_tokenizer_cannot_batch_is_refused_at_its_line(tmp_path, monkeypatch):
    """A tokenizer that cannot make the model's batches of a section's data (a CLM tokenizer without an EOS token):
    the dry run refuses it as the run would, naming the section, rather than skipping the count."""

    def no_eos(*args, **kwargs):
        raise InputError("CLM batches need a tokenizer with an EOS token to separate documents")

    monkeypatch.setattr(schema, "batch_count", no_eos)
    f = tmp_path / "bad.yaml"
    f.write_text(TINY + "    observe: {batches: 2}\n")
    with pytest.raises(StudyError, match=r"bad\.yaml:5: observe data 'validation': CLM batches need a tokenizer"):
        load_study(f)


def test_load_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    f = tmp_path / "bad.yaml"
    f.write_text(f"name: x\nmodels:\n  - load: {tmp_path / 'empty'}\n")
    with pytest.raises(StudyError, match=r"bad\.yaml:3: cannot load .*empty has no config\.json"):
        load_study(f)


def test_names_sharing_a_folder_are_named_with_their_lines(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nmodels:\n  - name: tiny a\n    preset: tiny-llama\n  - name: tiny_a\n    preset: tiny-opt\n")
    with pytest.raises(StudyError) as err:
        load_study(f)
    assert (
        "bad.yaml:5: cells 'tiny a/vanilla' (line 3) and 'tiny_a/vanilla' (line 5) would share the folder "
        "cells/tiny_a--vanilla"
    ) in str(err.value)


def test_dry_run_of_an_untrained_preset(tmp_path):
    f = tmp_path / "untrained.yaml"
    f.write_text("name: x\nmodels:\n  - preset: tiny-llama\n    config: {num_hidden_layers: 1}\n")
    assert "tiny-llama/vanilla (seed 0): build tiny-llama {'num_hidden_layers': 1} untrained" in plan(f)


def test_default_study_is_found_from_any_directory(tmp_path, monkeypatch, capsys):
    from quantgate.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["study", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("study quickstart: 3 cells")
    assert not (ROOT / "experiments" / "quickstart.yaml").exists()  # one copy: the packaged one


def test_a_second_run_on_a_busy_directory_stops_before_writing(tmp_path):
    out = tmp_path / "run"
    with run_lock(out), pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()}"):
        run_study(ROOT / "experiments" / "smoke.yaml", out)
    assert sorted(p.name for p in out.iterdir()) == [".quantgate.lock"]


def test_models_trained_here_are_evaluated_within_their_training_length(tmp_path):
    """lm-eval's windows default to the training seq_len for a trained model (not the model's position table:
    a tiny model trained on 128 tokens would be scored at 4,096); loaded models and computed tasks keep theirs;
    an explicit max_length wins."""
    from quantgate.study.steps import _eval_settings

    text = (
        "name: x\nmodels:\n  - name: trained\n    preset: tiny-llama\n    train: {steps: 2, seq_len: 64}\n"
        "  - name: explicit\n    preset: tiny-llama\n    train: {steps: 2, seq_len: 64}\n"
        "    eval: {max_length: 256}\n"
        "  - name: backcopy\n    preset: tiny-llama\n    train: {steps: 2, data: backcopy}\n"
        "    eval: {tasks: [quantgate_backcopy]}\n"
        "  - name: loaded\n    load: smollm2-135m\n"
    )
    (tmp_path / "s.yaml").write_text(text)
    models = {m.name: m for m in load_study(tmp_path / "s.yaml").models}
    settings = {name: _eval_settings(m).as_dict() for name, m in models.items()}  # as the step keys hash them
    assert settings["trained"]["max_length"] == 64
    assert settings["explicit"]["max_length"] == 256
    assert "max_length" not in settings["backcopy"] and "max_length" not in settings["loaded"]


def test_a_model_overrides_the_studys_calibration_key_by_key(tmp_path):
    (tmp_path / "s.yaml").write_text(
        TINY + "    calibration: {data: backcopy}\n  - name: other\n    preset: tiny-llama\ncalibration: {batches: 3}\n"
    )
    tiny, other = load_study(tmp_path / "s.yaml").models
    assert tiny.calibration.as_dict() == {"data": "backcopy", "batches": 3, "seq_len": 128, "batch_size": 8}
    assert other.calibration.as_dict() == {"data": "train", "batches": 3, "seq_len": 128, "batch_size": 8}
