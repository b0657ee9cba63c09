"""Corrupt or inconsistent model folders and data files: one line naming the file and the field (issue 31).

Grouped by the mechanism that catches them: config.json's quantgate record and the shapes its fields give
the model are checked when the folder is read (by every command: `quantgate info` here); a model and a
tokenizer are checked once where they meet (`qg.tokenizer(model)`, behind observe, quantize, train and
eval); a local dataset folder that datasets cannot read is searched for the file and line at fault."""

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import quantgate as qg
from quantgate.cli import main
from quantgate.data.corpus import corpus

corpus_module = importlib.import_module("quantgate.data.corpus")  # quantgate.data.corpus is also the function


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A G1-elementwise gated tiny Llama and a vanilla one, saved by qg.save."""
    root = tmp_path_factory.mktemp("saved")
    qg.save(qg.build("tiny-llama", "g1-elementwise"), root / "gated")
    qg.save(qg.build("tiny-llama"), root / "vanilla")
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root / "plain")  # as transformers writes it
    return root


def _edit_config(**fields):
    def edit(folder: Path) -> None:
        data = json.loads((folder / "config.json").read_text())
        for key, value in fields.items():
            if key.startswith("quantgate."):
                data["quantgate"][key.removeprefix("quantgate.")] = value
            else:
                data[key] = value
        (folder / "config.json").write_text(json.dumps(data))

    return edit


def _drop_quantgate_model_type(folder: Path) -> None:
    data = json.loads((folder / "config.json").read_text())
    del data["quantgate"]["model_type"]
    (folder / "config.json").write_text(json.dumps(data))


def _unrecorded_gates(then):
    """quantgate.safetensors as qg.save wrote it before it recorded the variant (the packaged twins'), then ``then``."""

    def edit(folder: Path) -> None:
        gates = folder / "quantgate.safetensors"
        save_file(load_file(gates), str(gates))
        then(folder)

    return edit


def _write(name: str, text: str):
    def edit(folder: Path) -> None:
        (folder / name).write_text(text)

    return edit


def _error_line(err: str, command: str) -> str:
    """The one error line the CLI wrote (progress bars of work done before it aside), without a traceback."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line or "Error" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"quantgate {command}: error: ") and err.endswith(lines[0] + "\n"), err
    return lines[0]


# (which checkpoint, what is done to it, the command, the fragment of the one-line error)
CORRUPT = {
    "record-is-a-string": (
        "gated",
        _edit_config(quantgate="g1-elementwise"),
        "info",
        "config.json: field 'quantgate' must be an object (the record qg.save writes), got a JSON "
        "string; restore the config.json saved with the model, or delete the field",
    ),
    "record-is-a-list": (
        "vanilla",
        _edit_config(quantgate=["vanilla"]),
        "info",
        "config.json: field 'quantgate' must be an object (the record qg.save writes), got a JSON array",
    ),
    "record-field-type": (
        "vanilla",
        _edit_config(**{"quantgate.variant": 5}),
        "info",
        "config.json: field 'quantgate.variant' must be a string, got a JSON number",
    ),
    "record-unknown-field": (  # a misspelt or newer field is not silently dropped
        "vanilla",
        _edit_config(**{"quantgate.variants": "g1-elementwise"}),
        "info",
        "config.json: field 'quantgate.variants' is not one quantgate writes; restore the config.json saved with "
        "the model",
    ),
    "record-lacks-model-type": (
        "gated",
        _drop_quantgate_model_type,
        "info",
        "its model_type is 'quantgate' and field 'quantgate.model_type' names None, which transformers does not know",
    ),
    "variant-to-another-gate": (
        "gated",
        _edit_config(**{"quantgate.variant": "g1-headwise"}),
        "info",
        "config.json: field 'quantgate.variant' is 'g1-headwise' but {dir}/quantgate.safetensors "
        "holds the gate weights of 'g1-elementwise': restore the config.json saved with these "
        "weights, or save the model again",
    ),
    "variant-same-shapes": (
        "gated",
        _edit_config(**{"quantgate.variant": "g5-output"}),
        "info",
        "config.json: field 'quantgate.variant' is 'g5-output' but {dir}/quantgate.safetensors "
        "holds the gate weights of 'g1-elementwise'",
    ),
    "variant-unrecorded-gates": (
        "gated",
        _unrecorded_gates(_edit_config(**{"quantgate.variant": "g1-headwise"})),
        "info",
        "quantgate.safetensors holds 4 tensors of other shapes than the model built from "
        "config.json (model.layers.0.self_attn.gate.proj.bias is [64], the model's [4], "
        "model.layers.0.self_attn.gate.proj.weight is [64, 64], the model's [4, 64], ...): "
        "config.json (its field 'quantgate.variant', which decides the gate tensors) "
        "disagrees with the weights",
    ),
    "sizes": (
        "vanilla",
        _edit_config(intermediate_size=96),
        "info",
        "model.safetensors holds 6 tensors of other shapes than the model built from config.json "
        "(model.layers.0.mlp.down_proj.weight is [64, 128], the model's [64, 96]",
    ),
    "plain-layers-raised": (  # transformers would add a block of random weights
        "plain",
        _edit_config(num_hidden_layers=3),
        "info",
        "model.safetensors lacks 9 tensors it needs (model.layers.2.input_layernorm.weight, "
        "model.layers.2.mlp.down_proj.weight, model.layers.2.mlp.gate_proj.weight, ...): config.json",
    ),
    # values out of range in a saved config.json (--config and study files were checked; loading was not)
    "config-hidden-act": (
        "vanilla",
        _edit_config(hidden_act="nonsense"),
        "info",
        "{dir}/config.json: hidden_act must be one of ",
    ),
    "config-negative-eps": (
        "vanilla",
        _edit_config(rms_norm_eps=-1.0),  # a float: transformers loads it, and the loss is NaN
        "info",
        "{dir}/config.json: rms_norm_eps must be > 0; got -1.0; restore the config.json saved with the model",
    ),
    "config-heads": (
        "vanilla",
        _edit_config(num_attention_heads=3),
        "info",
        "{dir}/config.json: num_attention_heads 3 is not a multiple of num_key_value_heads",
    ),
    "config-initializer-range": (
        "vanilla",
        _edit_config(initializer_range=1e30),
        "info",
        "{dir}/config.json: initializer_range must be in (0, 1]",
    ),
    "tokenizer-config-is-a-list": (
        "vanilla",
        _write("tokenizer_config.json", "[]"),
        "info",
        "tokenizer_config.json: it holds a JSON array, not an object; restore the "
        "tokenizer_config.json saved with the model",
    ),
    "tokenizer-truncated": (
        "vanilla",
        _write("tokenizer.json", '{"version": "1.0", "trunc'),
        "observe",
        "cannot read {dir}/tokenizer.json: Unterminated string",
    ),
    "shard-index-truncated": (
        "vanilla",
        _write("model.safetensors.index.json", '{"weight_map": {"a'),
        "info",
        "cannot read {dir}/model.safetensors.index.json: Unterminated string",
    ),
    "shard-index-not-a-map": (  # before: AttributeError's traceback
        "vanilla",
        _write("model.safetensors.index.json", '{"weight_map": ["model.safetensors"]}'),
        "info",
        "corrupt shard index {dir}/model.safetensors.index.json: its weight_map is not an object of file names",
    ),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_a_corrupt_or_edited_folder_is_one_line_naming_the_file_and_field(saved, tmp_path, monkeypatch, capsys, case):
    source, edit, command, fragment = CORRUPT[case]
    folder = tmp_path / "m"
    shutil.copytree(saved / source, folder)
    edit(folder)
    monkeypatch.chdir(tmp_path)
    argv = [command, str(folder)] + (
        ["--max-batches", "1", "--out", str(tmp_path / "o")] if command == "observe" else []
    )
    assert main(argv) == 2
    assert fragment.format(dir=folder) in _error_line(capsys.readouterr().err, command)


def test_a_bug_checking_a_config_or_finding_a_tokenizer_is_raised_not_a_refusal(saved, tmp_path, monkeypatch):
    """A plain ValueError from quantgate's own checks of config.json, or from where qg.save looks for the model's
    tokenizer, is a bug: it propagates as it is, instead of reading as a corrupt config.json or a model saved
    without its tokenizer. Without a tokenizer to be found (a refusal), the model is saved without one."""
    io = importlib.import_module("quantgate.models.io")

    def bug(*args, **kwargs):
        raise ValueError("a bug in the check")

    def refused(model):
        raise qg.InputError("no tokenizer is known for this model")

    monkeypatch.setattr(io, "check_config_values", bug)
    with pytest.raises(ValueError, match="a bug in the check") as caught:
        io.read_config(saved / "vanilla")
    assert not isinstance(caught.value, qg.QuantgateError)
    monkeypatch.undo()
    monkeypatch.setattr(io, "get_tokenizer", refused)
    qg.save(qg.build("tiny-llama"), tmp_path / "without")
    assert (tmp_path / "without" / "config.json").is_file() and not (tmp_path / "without" / "tokenizer.json").exists()
    monkeypatch.setattr(io, "get_tokenizer", bug)
    with pytest.raises(ValueError, match="a bug in the check"):
        qg.save(qg.build("tiny-llama"), tmp_path / "bug")


def test_an_intact_gated_checkpoint_still_loads_with_its_recorded_variant(saved):
    gated = qg.load(saved / "gated")
    assert str(qg.variant_of(gated)) == "g1-elementwise"
    reference = qg.build("tiny-llama", "g1-elementwise")
    ids = torch.randint(5, 8192, (1, 12))
    with torch.no_grad():
        assert torch.equal(gated(ids).logits, reference.eval()(ids).logits)


# --- a model and a tokenizer that do not belong together ------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama embedding 100 tokens, saved with the bundled 8192-token tokenizer it names."""
    path = tmp_path_factory.mktemp("vocab") / "m"
    qg.save(qg.build("tiny-llama", vocab_size=100), path, qg.tokenizer("bpe-8192"))
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["observe", "{dir}", "--max-batches", "1", "--out", "{tmp}/o"],
        ["quantize", "{dir}", "--scheme", "w8a8-int8-dynamic"],
        ["train", "--model", "{dir}", "--steps", "1", "--batch-size", "1", "--seq-len", "8", "--out", "{tmp}/run"],
        ["eval", "{dir}", "--limit", "1"],
    ],
    ids=["observe", "quantize", "train", "eval"],
)
def test_a_vocabulary_smaller_than_the_tokenizer_is_one_line_with_both_sizes(
    small_vocab, tmp_path, monkeypatch, capsys, argv
):
    monkeypatch.chdir(tmp_path)
    assert main([a.format(dir=small_vocab, tmp=tmp_path) for a in argv]) == 2
    err = _error_line(capsys.readouterr().err, argv[0])
    assert (
        f"the tokenizer has 8192 tokens but the model embeds only 100 ({small_vocab}/config.json vocab_size; "
        f"tokenizer {small_vocab}): they do not belong together; pair the model with a tokenizer of at most 100 "
        f"tokens, or give it a vocab_size of at least 8192"
    ) in err


def test_a_preset_built_with_a_smaller_vocabulary_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [
        "train",
        "--preset",
        "tiny-llama",
        "--config",
        "vocab_size=100",
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--seq-len",
        "8",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    assert "the tokenizer has 8192 tokens but the model embeds only 100 (vocab_size; tokenizer bpe-8192)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "run" / "model").exists()


# --- local dataset folders --------------------------------------------------------------------------


@pytest.fixture
def datasets_here(tmp_path, monkeypatch):
    """datasets' and quantgate's caches in tmp_path, and the hub declared off limits (nothing downloads)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("QUANTGATE_CACHE", str(tmp_path / "qg-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        (
            "train.json",
            b'{"text": "fine"}\n{"text": "lone \\ud800 surrogate"}\n',
            "train.json line 2 holds a lone surrogate escape (\\ud800), which is not text; fix or remove that file",
        ),
        (
            "train.json",
            b'[{"text": "fine"},\n {"text": "lone \\udc00"}]\n',
            "train.json holds a lone surrogate escape (\\udc00), which is not text; fix or remove that file",
        ),
        (
            "train.txt",
            b"fine\n\xed\xa0\x80 a raw surrogate\n",
            "train.txt is not UTF-8 text (byte 5: invalid continuation byte); fix or remove that file",
        ),
    ],
    ids=["json-lines-escape", "json-array-escape", "text-raw-bytes"],
)
def test_an_unreadable_local_dataset_file_is_named(
    datasets_here, tmp_path, monkeypatch, capsys, name, content, fragment
):
    (datasets_here / name).write_bytes(content)
    source = f"hf:{datasets_here}:train"
    with pytest.raises(ValueError) as e:
        list(corpus(source))
    assert str(e.value) == f"text source {source!r}: {datasets_here / fragment}"
    monkeypatch.chdir(tmp_path)
    argv = ["observe", "tiny-llama", "--data", source, "--max-batches", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert str(datasets_here / fragment) in _error_line(capsys.readouterr().err, "observe")


def test_a_local_dataset_folder_needs_no_hub_and_names_a_missing_column(datasets_here, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_hub(timeout: float = 3.0) -> bool:
        raise AssertionError("a local folder was sent to the hub check")

    monkeypatch.setattr(corpus_module, "hub_reachable", no_hub)
    (datasets_here / "train.jsonl").write_text('{"body": "first"}\n{"body": "second"}\n')
    assert [d.text for d in corpus(f"hf:{datasets_here}:train:body")] == ["first", "second"]
    with pytest.raises(
        ValueError,
        match=r"has no column 'text' \(it has body\); name the text column: "
        r"hf:.*:train:<column>",
    ):
        list(corpus(f"hf:{datasets_here}:train"))
