"""Quantization that cannot silently go wrong: non-finite calibration data and weights, a tampered
manifest or config, weights the built model does not use, and options outside their valid range."""

import dataclasses
import hashlib
import json
import shutil
from typing import cast

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import OPTForCausalLM

import quantgate as qg
from quantgate.quant import get_scheme
from quantgate.quant.schemes import SimulatedScheme
from quantgate.quant.simulate import act_quantizers
from quantgate.variants import AttentionVariant, ClipSpec, SinkSpec

IDS = torch.randint(5, 8192, (2, 16), generator=torch.Generator().manual_seed(1))


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, 8192, (2, 16), generator=g)} for _ in range(n)]


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


# --- 1. non-finite calibration data and weights ------------------------------------------------


def _poison_fc1_input(model, value):
    """A float model whose first fc1 input holds one non-finite value (as an overflowing model would)."""

    def hook(module, args):
        x = args[0].clone()
        x.view(-1)[0] = value
        return (x,)

    model.model.decoder.layers[0].fc1.register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("scheme", ["w8a8-int8-static", "w8a8-fp8-e4m3:estimator=percentile", "torchao-int8-static"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_calibration_names_the_quantizer(scheme, value):
    model = _poison_fc1_input(qg.build("tiny-opt"), value)
    with pytest.raises(
        ValueError,
        match=r"model\.decoder\.layers\.0\.fc1 input: the calibration activations "
        r"hold NaN or inf",
    ):
        qg.quantize(model, scheme, calibration=_batches())
    assert qg.quantization_of(model) is None


def test_bondarenko_quantizers_are_named_by_module_and_tensor():
    q = qg.quantize(qg.build("tiny-opt"), "w8a8-int8-static:acts=bondarenko", calibration=_batches(1))
    named = {n: m.name for n, m in q.named_modules() if m in set(act_quantizers(q))}
    assert named["model.decoder.layers.0.fc2.input_quant"] == "model.decoder.layers.0.fc2 input"
    assert named["model.decoder.layers.0.input_quant"] == "model.decoder.layers.0 input"  # the embedding sum
    assert named["model.decoder.layers.1.self_attn.qg_fake_quant.probs"] == "model.decoder.layers.1.self_attn probs"
    assert named["model.decoder.layers.1.output_quant"] == "model.decoder.layers.1 output"


def test_save_refuses_non_finite_ranges_and_writes_nothing(tmp_path):
    q = cast(OPTForCausalLM, qg.quantize(qg.build("tiny-opt"), "w8a8-int8-static", calibration=_batches()))
    q.model.decoder.layers[1].fc2.input_quant.hi.fill_(float("nan"))
    with pytest.raises(
        ValueError,
        match=r"model\.decoder\.layers\.1\.fc2 input: its range \[.*, nan\] is not "
        r"finite",
    ):
        qg.save(q, tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("scheme", ["w8-int8", "w8a8-int8-dynamic", "llm-int8"])
def test_non_finite_weights_are_refused_before_quantizing(scheme):
    model = cast(OPTForCausalLM, qg.build("tiny-opt"))
    with torch.no_grad():
        model.model.decoder.layers[1].self_attn.v_proj.weight[3, 2] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"model\.decoder\.layers\.1\.self_attn\.v_proj\.weight holds 1 NaN or "
        r"inf value",
    ):
        qg.quantize(model, scheme, calibration=_batches())


# --- 2. the manifest is checked against its schema, config.json and the weights ----------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A quantized tiny OPT saved once, and its logits."""
    path = tmp_path_factory.mktemp("saved") / "q"
    q = qg.quantize(qg.build("tiny-opt"), "w8a8-int8-static", calibration=_batches()).eval()
    qg.save(q, path)
    return path, _logits(q)


def _copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "q")
    return tmp_path / "q"


def _edit_json(file, **changes):
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_the_saved_checkpoint_loads_identically_and_records_its_weights_hash(saved, tmp_path):
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / "quantization.json").read_text())
    assert manifest["weights_sha256"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert torch.equal(_logits(qg.load(path)), saved[1])


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", r"cannot read .*quantization\.json: Expecting .*save the quantized model again"),
        ("[]", r"quantization\.json: it holds a JSON array, not an object"),
        ("{}", r"quantization\.json: field 'scheme' is missing"),
    ],
)
def test_garbage_manifest_names_the_file(saved, tmp_path, text, fragment):
    path = _copy(saved, tmp_path)
    (path / "quantization.json").write_text(text)
    with pytest.raises(ValueError, match=fragment):
        qg.load(path)


def test_a_bug_in_a_manifest_check_keeps_its_traceback(saved, tmp_path, monkeypatch):
    """A plain ValueError where the manifest's scheme is parsed is a bug, not the file's fault: it propagates as it
    is, instead of reading as "field 'scheme' is not a valid scheme"."""
    path = _copy(saved, tmp_path)

    def broken(text):
        raise ValueError("a bug in the parser")

    monkeypatch.setattr("quantgate.quant.manifest.get_scheme", broken)
    with pytest.raises(ValueError, match="a bug in the parser") as caught:
        qg.load(path)
    assert not isinstance(caught.value, qg.QuantgateError)


def test_a_bug_finding_the_tokenizer_is_not_saving_without_one(saved, tmp_path, monkeypatch):
    """qg.save without a tokenizer it can find saves the model without one; a bug where it looks is raised."""
    model = qg.load(saved[0])

    def refused(model):
        raise qg.InputError("no tokenizer is known for this model")

    monkeypatch.setattr("quantgate.quant.manifest.get_tokenizer", refused)
    qg.save(model, tmp_path / "without")
    assert not (tmp_path / "without" / "tokenizer.json").exists()

    def broken(model):
        raise ValueError("a bug finding the tokenizer")

    monkeypatch.setattr("quantgate.quant.manifest.get_tokenizer", broken)
    with pytest.raises(ValueError, match="a bug finding the tokenizer"):
        qg.save(model, tmp_path / "bug")


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("aliases", [], r"field 'aliases' is a JSON array, not an object"),
        ("scheme", 8, r"field 'scheme' is 8, not a string"),
        ("scheme", "w9a9", r"field 'scheme' is not a valid scheme: unknown quantization scheme 'w9a9'"),
        (
            "scheme",
            "w8a8-fp8-e4m3",
            r"field 'scheme' \('w8a8-fp8-e4m3'\) disagrees with .*config\.json "
            r"\('w8a8-int8-static'\)",
        ),
        ("variant", "g1-headwise", r"field 'variant' \('g1-headwise'\) disagrees with .*config\.json \('vanilla'\)"),
        ("family", "llama", r"field 'family' \('llama'\) disagrees with .*config\.json \('opt'\)"),
    ],
)
def test_edited_manifest_field_is_named(saved, tmp_path, field, value, fragment):
    path = _copy(saved, tmp_path)
    _edit_json(path / "quantization.json", **{field: value})
    with pytest.raises(ValueError, match=r"quantization\.json.*" + fragment):
        qg.load(path)


def test_changed_weights_do_not_match_the_manifest(saved, tmp_path):
    path = _copy(saved, tmp_path)
    weights = path / "model.safetensors"  # compressed-tensors layout
    state = load_file(weights)
    key = next(k for k in state if k.endswith("fc1.weight"))
    state[key] = state[key] * 2
    save_file(state, weights)  # a valid file with other values
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors does not match the sha256 recorded in .*"
        r"quantization\.json \(field 'weights_sha256'\)",
    ):
        qg.load(path)


# --- 3. weights the model built from config.json does not use ----------------------------------


def test_gated_checkpoint_edited_to_vanilla_refuses_its_gate_weights(tmp_path):
    qg.save(qg.build("tiny-opt", "g1-headwise"), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    data["quantgate"]["variant"] = "vanilla"
    config.write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=r"quantgate\.safetensors holds \d+ tensors the model built from "
        r"config\.json does not use \(.*self_attn\.gate\.proj",
    ):
        qg.load(tmp_path / "m")


def test_base_weights_the_config_does_not_use_are_refused(tmp_path):
    qg.save(qg.build("tiny-opt"), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    data["num_hidden_layers"] = 1
    config.write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors holds \d+ tensors the model built from config\.json "
        r"does not use \(.*layers\.1\.",
    ):
        qg.load(tmp_path / "m")


# --- 4. options outside their valid range --------------------------------------------------------


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("w8a8-int8-static:percentile=150", "w8a8-int8-static: percentile must be in (50, 100], got 150"),
        ("w8a8-int8-static:percentile=-1", "percentile must be in (50, 100], got -1"),
        ("w8a8-int8-static:percentile=50", "percentile must be in (50, 100], got 50"),
        ("w8a8-int8-static:percentile=nan", "percentile must be a finite number, got nan"),
        ("w8a8-int8-static:momentum=5", "momentum must be in [0, 1), got 5"),
        ("w8a8-int8-static:momentum=1", "momentum must be in [0, 1), got 1"),
        ("w8a8-int8-static:momentum=inf", "momentum must be a finite number, got inf"),
        ("llm-int8:threshold=-1", "llm-int8: threshold must be >= 0, got -1"),
        ("llm-int8:threshold=nan", "threshold must be a finite number, got nan"),
        ("w8-int8:group_size=0", "w8-int8: group_size must be >= 1, got 0"),
    ],
)
def test_scheme_options_outside_their_range(text, fragment):
    with pytest.raises(ValueError) as err:
        get_scheme(text)
    assert fragment in str(err.value)


def test_scheme_ranges_hold_for_the_python_api():
    s = get_scheme("w8a8-int8-static")
    assert isinstance(s, SimulatedScheme) and s.act is not None
    with pytest.raises(ValueError, match=r"percentile must be in \(50, 100\], got 150"):
        dataclasses.replace(s, act=dataclasses.replace(s.act, percentile=150.0))
    with pytest.raises(ValueError, match="calib must be >= 1, got 0"):
        dataclasses.replace(s, calib=0)
    with pytest.raises(ValueError, match="estimator must be one of minmax, running-minmax, percentile, mse"):
        dataclasses.replace(s, act=dataclasses.replace(s.act, estimator="magic"))
    with pytest.raises(ValueError, match="per-token activation ranges are dynamic"):
        dataclasses.replace(s, act=dataclasses.replace(s.act, granularity="token"))


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("clipped:gamma=nan", "clipped: gamma must be a finite number, got nan"),
        ("clipped:gamma=-inf", "clipped: gamma must be a finite number, got -inf"),
        ("clipped:zeta=nan", "clipped: zeta must be a finite number, got nan"),
        ("clipped:zeta=inf", "clipped: zeta must be a finite number, got inf"),
        ("clipped:alpha=nan", "clipped: alpha must be a finite number, got nan"),
        ("clipped:alpha=inf", "clipped: alpha must be a finite number, got inf"),
        ("sink:init=nan", "sink: init must be a finite number, got nan"),
        ("sink:init=-inf", "sink: init must be a finite number, got -inf"),
    ],
)
def test_variant_parameters_must_be_finite(text, fragment):
    with pytest.raises(ValueError) as err:
        AttentionVariant.parse(text)
    assert fragment in str(err.value)


def test_variant_ranges_hold_for_the_python_api():
    with pytest.raises(ValueError, match="clipped: zeta must be a finite number, got nan"):
        ClipSpec(zeta=float("nan"))
    with pytest.raises(ValueError, match="sink: init must be a finite number, got inf"):
        SinkSpec(float("inf"))


@pytest.mark.parametrize(
    "text",
    [
        "w8a8-int8-static:estimator=percentile,percentile=100",
        "w8a8-int8-static:momentum=0",
        "llm-int8:threshold=0",
        "w4-int4-group:group_size=1",
        "torchao-int8-static:calib=1",
    ],
)
def test_valid_scheme_edges_parse(text):
    assert get_scheme(str(get_scheme(text))) == get_scheme(text)


@pytest.mark.parametrize(
    "text",
    [
        "clipped:gamma=0",
        "clipped:gamma=-0.5,zeta=1",
        "clipped:alpha=0,zeta=1.2",
        "sink:init=-5.5",
        "g1-headwise:pi_init=0.999",
    ],
)
def test_valid_variant_edges_parse(text):
    v = AttentionVariant.parse(text)
    assert AttentionVariant.parse(str(v)) == v
