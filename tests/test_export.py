"""Checkpoints that cross the boundary: what qg.save writes, plain transformers (and lm-eval's hf model)
loads as the same model, or refuses naming quantgate; never as a different model."""

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from conftest import run_python
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

import quantgate as qg

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(5, 8000, (2, 24), generator=torch.Generator().manual_seed(0))

# scheme -> (the quant_method transformers reads, the compressed-tensors format, exact logits in transformers)
EXPORTS = {
    "w8a8-int8-static": ("compressed-tensors", "int-quantized", True),
    "w8a8-int8-dynamic": ("compressed-tensors", "int-quantized", False),  # per-token scale: amax/127.5 there
    "w8a8-fp8-e4m3": ("compressed-tensors", "float-quantized", True),
    "w8a8-fp8-e4m3:dynamic=true": ("compressed-tensors", "float-quantized", True),
    "w8-int8": ("compressed-tensors", "pack-quantized", True),
    "w4-int4-group": ("compressed-tensors", "naive-quantized", True),  # asymmetric: zero points unpacked
    "w4-int4-group:w_symmetric=true": ("compressed-tensors", "pack-quantized", True),
    "w4a4-nvfp4": ("compressed-tensors", "nvfp4-pack-quantized", False),  # transformers computes it in bf16
    "torchao-int8-dynamic": ("torchao", None, True),
    "torchao-int8-weight-only": ("torchao", None, True),
    "llm-int8": ("bitsandbytes", None, True),
}
REFUSED = ["w8a8-int8-bondarenko", "kv8-int8", "w8a8-int8-static:rotate=online", "w8a8-int8-static:a_bits=6"]


@pytest.fixture(scope="module")
def float_model():
    return qg.build("tiny-llama")


@pytest.fixture(scope="module")
def calib(float_model):
    return list(qg.data.batches(qg.tokenizer(float_model), "train", seq_len=64, batch_size=4, max_batches=4))


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _plain(path):
    """transformers alone, as lm-eval's hf model and every other reader load it."""
    model, info = cast(  # output_loading_info: (model, loading info), which transformers' hints do not say
        tuple[PreTrainedModel, dict[str, Any]],
        AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype="auto"),
    )
    return model.eval(), info


def _loss(logits):
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()))


@pytest.mark.parametrize("scheme", EXPORTS)
def test_export_loads_in_plain_transformers_as_the_same_model(scheme, float_model, calib, tmp_path):
    method, fmt, exact = EXPORTS[scheme]
    q = qg.quantize(float_model, scheme, calibration=calib)
    qg.save(q, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["quantization_config"]["quant_method"] == method
    assert json.loads((tmp_path / "quantization.json").read_text())["format"] == method
    if fmt is not None:
        assert config["quantization_config"]["format"] == fmt
    reloaded = _logits(qg.load(tmp_path))
    assert torch.equal(reloaded, _logits(q))  # quantgate reads its export back bit for bit
    plain, info = _plain(tmp_path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = _logits(plain).float()
    if exact:
        assert float((theirs - reloaded).abs().max()) <= 1e-4
    else:
        assert abs(_loss(theirs) / _loss(reloaded) - 1) < 0.005
        assert float((theirs - reloaded).abs().max()) < 0.25  # bf16 arithmetic for NVFP4


def test_packed_weights_are_integers_and_fp8_on_disk(float_model, calib, tmp_path):
    def dtypes(path, suffix):
        with safe_open(str(path / "model.safetensors"), "pt") as fh:
            return {fh.get_slice(k).get_dtype() for k in fh.keys() if k.endswith(suffix) and ".layers." in k}

    linear_in = float_model.model.layers[0].self_attn.q_proj.in_features
    for scheme, suffix, dtype in (
        ("w8a8-int8-static", "proj.weight", "I8"),
        ("w8a8-fp8-e4m3", "proj.weight", "F8_E4M3"),
        ("w8-int8", "proj.weight_packed", "I32"),
    ):
        qg.save(qg.quantize(float_model, scheme, calibration=calib), tmp_path / scheme)
        assert dtypes(tmp_path / scheme, suffix) == {dtype}, scheme
    with safe_open(str(tmp_path / "w8-int8" / "model.safetensors"), "pt") as fh:
        assert fh.get_slice("model.layers.0.self_attn.q_proj.weight_packed").get_shape()[1] == linear_in // 4


@pytest.mark.parametrize("scheme", REFUSED)
def test_what_no_other_format_holds_is_refused_naming_quantgate(scheme, float_model, calib, tmp_path):
    q = qg.quantize(float_model, scheme, calibration=calib)
    qg.save(q, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "quantgate"
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="model type `quantgate`"):
        _plain(tmp_path)
    assert torch.equal(_logits(qg.load(tmp_path)), _logits(q))


@pytest.mark.parametrize("variant", ["g1-elementwise", "clipped:gamma=-0.025", "sink"])
def test_gated_clipped_and_sink_checkpoints_are_never_built_ungated(variant, tmp_path):
    model = qg.build("tiny-llama", variant=variant)
    qg.save(model, tmp_path / "float")
    with pytest.raises(ValueError, match="model type `quantgate`"):
        _plain(tmp_path / "float")
    assert torch.equal(_logits(qg.load(tmp_path / "float")), _logits(model))
    q = qg.quantize(model, "w8a8-int8-dynamic")  # expressible for an ungated model, not for this one
    qg.save(q, tmp_path / "q")
    with pytest.raises(ValueError, match="model type `quantgate`"):
        _plain(tmp_path / "q")
    assert torch.equal(_logits(qg.load(tmp_path / "q")), _logits(q))


def test_an_ungated_float_checkpoint_stays_plain_transformers(float_model, tmp_path):
    qg.save(float_model, tmp_path)
    plain, info = _plain(tmp_path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(_logits(plain), _logits(float_model))


def test_the_packaged_gated_twin_is_refused_by_plain_transformers():
    with pytest.raises(ValueError, match="model type `quantgate`"):
        _plain(qg.models.sources.resolve("twin-g1"))
    assert qg.variant_of(qg.load("twin-g1")) == qg.AttentionVariant.parse("g1-elementwise")


def test_a_resave_in_another_format_leaves_no_stale_weights(float_model, calib, tmp_path):
    qg.save(qg.quantize(float_model, "w8a8-int8-bondarenko", calibration=calib), tmp_path)
    assert (tmp_path / "quantized.safetensors").is_file()
    q = qg.quantize(float_model, "w8-int8")
    qg.save(q, tmp_path)
    assert not (tmp_path / "quantized.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    assert torch.equal(_logits(qg.load(tmp_path)), _logits(q))


def test_lm_eval_hf_on_an_export_gives_quantgate_evals_number(float_model, calib, tmp_path):
    """lm-eval's own CLI with its hf model, quantgate's task folder, and quantgate's conventions (no BOS of
    the tokenizer's own, lm-eval's prefix token instead; 4,096-token windows)."""
    q = qg.quantize(float_model, "w8a8-int8-static", calibration=calib)
    qg.save(q, tmp_path / "q")
    ours = qg.evaluate(qg.load(tmp_path / "q"), tasks=["quantgate_ppl"], limit=2).results["quantgate_ppl"]
    args = "pretrained={},dtype=float32,add_bos_token=False,max_length=4096".format(tmp_path / "q")
    cmd = ["-m", "lm_eval", "--model", "hf", "--model_args", args, "--tasks", "quantgate_ppl"]
    cmd += ["--include_path", str(ROOT / "quantgate" / "tasks"), "--limit", "2", "--batch_size", "8"]
    cmd += ["--output_path", str(tmp_path / "lm_eval")]
    run_python(cmd, check=True, capture_output=True, text=True, cwd=tmp_path)
    (results,) = (tmp_path / "lm_eval").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["quantgate_ppl"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        value = next(v for k, v in theirs.items() if re.fullmatch(f"{metric},none", k))
        assert value == pytest.approx(ours[metric], rel=1e-3)
