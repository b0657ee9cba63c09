"""Checkpoints other tools quantized (compressed-tensors / llm-compressor, transformers' TorchAoConfig and
BitsAndBytesConfig): quantgate names their scheme (info, eval.json, observe), refuses to quantize them
again, and compare measures them against their float source given with --baseline or a sidecar's hash."""

import csv
import importlib
import json
import re
import sys
from types import SimpleNamespace
from typing import cast

import pytest
import torch

import quantgate as qg
from quantgate.cli import main
from quantgate.errors import InputError
from quantgate.models.families import config_of
from quantgate.models.record import QuantizationRecord
from quantgate.quant.imported import ImportedQuantization, check_installed, dequantize_, describe
from quantgate.stats import format_delta, paired_delta

CT_LABEL = "compressed-tensors:w8a8-int8 (weights int8 channel symmetric, activations int8 token dynamic)"
AO_LABEL = "torchao:Int8WeightOnlyConfig"
BNB_LABEL = "bitsandbytes:llm-int8(threshold=6.0)"
EVAL = ["--tasks", "quantgate_ppl", "--limit", "3"]


def _write_compressed_tensors(float_dir, out):
    """W8A8 (INT8 weights per channel, dynamic per-token INT8 activations) the way llm-compressor's oneshot
    writes it: apply the preset scheme, set the weight scales from the observed ranges, compress, save,
    and put the quantization_config into config.json."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        assert isinstance(module.weight, torch.Tensor)
        w = module.weight.detach()
        scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
        update_offload_parameter(module, "weight_scale", scale)
        update_offload_parameter(module, "weight_zero_point", zero)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    qg.tokenizer(qg.load(float_dir)).save_pretrained(out)
    return out


def _write_hf(float_dir, out, quantization_config):
    """A checkpoint transformers quantizes on load and saves (safetensors)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantization_config)
    model.save_pretrained(out, safe_serialization=True)
    qg.tokenizer(qg.load(float_dir)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, TorchAoConfig

    root = tmp_path_factory.mktemp("imported")
    float_dir = qg.save(qg.build("tiny-llama"), root / "float")
    assert main(["eval", str(float_dir), *EVAL, "--out", str(root / "ev_float")]) == 0
    return {
        "root": root,
        "float": float_dir,
        "ct": _write_compressed_tensors(float_dir, root / "ct"),
        "ao": _write_hf(float_dir, root / "ao", TorchAoConfig(Int8WeightOnlyConfig())),
        "bnb": _write_hf(float_dir, root / "bnb", BitsAndBytesConfig(load_in_8bit=True)),
        "fp_eval": root / "ev_float",
    }


@pytest.mark.parametrize(
    "kind, label, origin",
    [
        ("ct", CT_LABEL, "compressed-tensors"),
        ("ao", AO_LABEL, "torchao"),
        ("bnb", BNB_LABEL, "bitsandbytes"),
    ],
)
def test_info_eval_and_compare_name_the_scheme_and_pair_with_baseline(ckpts, capsys, kind, label, origin):
    assert (ckpts[kind] / "model.safetensors").is_file() and not list(ckpts[kind].glob("*.bin"))
    capsys.readouterr()
    assert main(["info", str(ckpts[kind])]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"quantization\s+{re.escape(label)}\n", out) and re.search(rf"quantized by\s+{origin}\n", out)

    ev = ckpts["root"] / f"ev_{kind}"
    assert main(["eval", str(ckpts[kind]), *EVAL, "--out", str(ev)]) == 0
    q = json.loads((ev / "eval.json").read_text())
    fp = json.loads((ckpts["fp_eval"] / "eval.json").read_text())
    s = q["settings"]
    assert s["quantization"] == label and s["quantization_origin"] == origin
    assert s["source_sha256"] is None and len(s["model_sha256"]) == 64 != fp["settings"]["model_sha256"]
    assert fp["settings"]["quantization"] is None and fp["settings"]["source_sha256"] is None

    # third-party files carry no quantgate source hash: unpaired, until --baseline names the float run
    capsys.readouterr()
    assert main(["compare", str(ckpts["fp_eval"]), str(ev)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if label in line)
    assert "| none: no source hash recorded; pass --baseline | " in row and row.endswith("| - |")
    cmp = ckpts["root"] / f"cmp_{kind}"
    assert main(["compare", str(ev), "--baseline", str(ckpts["fp_eval"]), "--out", str(cmp)]) == 0
    table = (cmp / "compare.md").read_text()
    paired = paired_delta(fp["documents"]["quantgate_ppl"], q["documents"]["quantgate_ppl"], "word_perplexity")
    assert paired.low is not None and paired.high is not None and paired.low < paired.high and paired.value != 0
    row = next(line for line in table.splitlines() if label in line)
    assert f"(--baseline) | {q['results']['quantgate_ppl']['word_perplexity']:.4g} | {format_delta(paired)} |" in row
    assert table.splitlines()[2].startswith(f"| {ckpts['float']} | vanilla | - | float | baseline |")
    with open(cmp / "compare.csv") as fh:
        rows = {r["scheme"]: r for r in csv.DictReader(fh)}
    got = [float(rows[label][f"quantgate_ppl/word_perplexity delta{end}"]) for end in ("", " low", " high")]
    assert got == pytest.approx([paired.value, paired.low, paired.high])


@pytest.mark.parametrize("kind, label", [("ct", CT_LABEL), ("ao", AO_LABEL), ("bnb", BNB_LABEL)])
def test_quantize_refuses_a_quantized_checkpoint(ckpts, kind, label):
    model = qg.load(ckpts[kind])
    record = qg.quantization_of(model)
    assert record is not None and record.scheme == label
    for scheme in ("w8-int8", "torchao-int8-weight-only"):
        with pytest.raises(ValueError) as err:
            qg.quantize(model, scheme)
        text = str(err.value)
        assert f"this model is already quantized ({label}, from its config.json's quantization_config)" in text
        assert "load the float checkpoint it was made from" in text
        assert ("dequantize=True" in text) == (kind != "ao")
    if kind == "ao":
        with pytest.raises(ValueError, match="torchao models cannot be dequantized here"):
            qg.quantize(model, "w8-int8", dequantize=True)
    # the CLI refuses in one line
    assert main(["eval", str(ckpts[kind]), "--scheme", "w8-int8", *EVAL]) == 2


def test_quantgate_records_refuse_too():
    q = qg.quantize(qg.build("tiny-llama"), "w8-int8")
    with pytest.raises(ValueError, match=r"already quantized \(w8-int8\); .* float source \(tiny-llama\)"):
        qg.quantize(q, "w8a8-int8-static", calibration=[])
    ao = qg.quantize(qg.build("tiny-llama"), "torchao-int8-weight-only")
    config_of(ao).quantgate.pop("quantization")  # the record gone: its torchao tensors still say it
    record = qg.quantization_of(ao)
    assert record is not None and record.scheme == "torchao:Int8Tensor (quantized tensors, no quantization_config)"
    with pytest.raises(ValueError, match=r"already quantized .*from its tensors"):
        qg.quantize(ao, "w8-int8")
    with pytest.raises(ValueError, match="not quantized; leave dequantize out"):
        qg.quantize(qg.build("tiny-llama"), "w8-int8", dequantize=True)


def test_dequantize_gives_the_stored_int8_times_scale(ckpts):
    from safetensors.torch import load_file

    stored = load_file(str(ckpts["ct"] / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj"
    expected = stored[f"{key}.weight"].float() * stored[f"{key}.weight_scale"]
    assert stored[f"{key}.weight"].dtype == torch.int8
    model = qg.load(ckpts["ct"])
    q = qg.quantize(model, "w8-int8", dequantize=True)
    record = qg.quantization_of(q)
    assert isinstance(record, QuantizationRecord) and record.origin == "quantgate"
    assert record.dequantized_from == CT_LABEL
    source = qg.quantization_of(model)
    assert source is not None and source.scheme == CT_LABEL  # the source model is untouched
    float_model = dequantize_(qg.load(ckpts["ct"]))
    assert qg.quantization_of(float_model) is None
    weight = float_model.get_submodule(key).weight
    assert isinstance(weight, torch.Tensor) and torch.equal(weight, expected)
    assert not any(hasattr(m, "quantization_scheme") for m in float_model.modules())
    bnb = qg.quantization_of(qg.quantize(qg.load(ckpts["bnb"]), "w8-int8", dequantize=True))
    assert isinstance(bnb, QuantizationRecord) and bnb.dequantized_from == BNB_LABEL


def test_records_and_observe_name_the_fields(ckpts):
    ct = qg.quantization_of(qg.load(ckpts["ct"]))
    assert isinstance(ct, ImportedQuantization) and ct.settings["weights"] == {
        "num_bits": 8,
        "type": "int",
        "strategy": "channel",
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
    }
    settings = ct.settings
    assert settings["input_activations"]["strategy"] == "token" and settings["input_activations"]["dynamic"] is True
    assert settings["ignore"] == ["lm_head"] and settings["format"] == "int-quantized"
    assert settings["kv_cache_scheme"] is None
    ao = qg.quantization_of(qg.load(ckpts["ao"]))
    assert isinstance(ao, ImportedQuantization) and ao.settings["config"] == "Int8WeightOnlyConfig"
    bnb = qg.quantization_of(qg.load(ckpts["bnb"]))
    assert isinstance(bnb, ImportedQuantization)
    assert (bnb.settings["bits"], bnb.settings["threshold"], bnb.settings["has_fp16_weight"]) == (8, 6.0, False)
    model = qg.load(ckpts["ct"])
    report = qg.observe(model, qg.data.batches(qg.tokenizer(model), "validation", 16, 2, max_batches=1), progress=False)
    assert report.meta.quantization == CT_LABEL and f"quantized {CT_LABEL})" in report.markdown()


def test_labels_of_other_configs():
    assert (
        describe({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}).scheme
        == "gptq:w4g128(sym)"
    )
    assert (
        describe({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}).scheme
        == "awq:w4g128(zero_point, gemm)"
    )
    assert (
        describe(
            {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_compute_dtype": "bfloat16",
                "bnb_4bit_use_double_quant": True,
            }
        ).scheme
        == "bitsandbytes:nf4(compute_dtype=bfloat16, double_quant)"
    )
    fp8 = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    assert describe(fp8).scheme == (
        "compressed-tensors:w8a8-fp8 (weights fp8 channel symmetric, activations fp8 "
        "token dynamic); kv-cache fp8 tensor static"
    )
    w4 = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False},
            }
        },
    }
    assert describe(w4).scheme == "compressed-tensors:w4a16-int4 (weights int4 group 128 asymmetric)"


@pytest.mark.parametrize(
    "kind, module, command",
    [
        ("ct", "compressed_tensors", "pip install 'compressed-tensors>=0.20.1,<0.21'"),
        ("ao", "torchao", "pip install 'torchao>=0.18,<0.19'"),
        ("bnb", "bitsandbytes", "pip install 'bitsandbytes>=0.50,<0.51'"),
    ],
)
def test_a_missing_package_is_one_line_with_its_pip_command(ckpts, capsys, monkeypatch, kind, module, command):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    capsys.readouterr()
    assert main(["info", str(ckpts[kind])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and f"({command})" in err
    from quantgate.models.io import read_config

    with pytest.raises(ModuleNotFoundError, match="is quantized with"):
        check_installed(read_config(ckpts[kind]), ckpts[kind])


def test_an_unreadable_sidecar_is_refused_in_one_line_and_a_bug_reading_it_is_raised(tmp_path, monkeypatch):
    """A quantization.json beside a foreign checkpoint that is not a JSON object is refused, naming the file and the
    fix (it is read, as every file quantgate reads back); one with a field of another type says nothing of it; a
    plain ValueError from the code reading it is a bug and propagates."""
    imported = importlib.import_module("quantgate.quant.imported")
    model = cast(torch.nn.Module, SimpleNamespace(config=SimpleNamespace(_name_or_path=str(tmp_path))))
    (tmp_path / imported.SIDECAR).write_text("{not json")
    with pytest.raises(InputError, match=r"cannot read .*quantization\.json: .*restore the quantization\.json"):
        imported._sidecar(model)
    (tmp_path / imported.SIDECAR).write_text(json.dumps({"source_sha256": 5, "source_model": "m"}))
    assert imported._sidecar(model) == imported.Sidecar(str(tmp_path / imported.SIDECAR), None, "m")

    def bug(*args, **kwargs):
        raise ValueError("a bug in the reader")

    monkeypatch.setattr(imported, "read_json", bug)
    with pytest.raises(ValueError, match="a bug in the reader"):
        imported._sidecar(model)


def test_a_sidecar_source_hash_pairs_a_foreign_checkpoint_with_its_float_run(ckpts):
    """A compressed-tensors folder with quantgate's quantization.json beside it, loaded by transformers:
    its source hash pairs it with the float run, no --baseline needed."""
    from transformers import AutoModelForCausalLM

    fp = json.loads((ckpts["fp_eval"] / "eval.json").read_text())
    folder = ckpts["root"] / "ct_sidecar"
    _write_compressed_tensors(ckpts["float"], folder)
    sidecar = {"scheme": "w8a8-int8-dynamic", "source_sha256": fp["settings"]["model_sha256"], "source_model": "x"}
    (folder / "quantization.json").write_text(json.dumps(sidecar))
    model = AutoModelForCausalLM.from_pretrained(folder)
    record = qg.quantization_of(model)
    assert record is not None and record.scheme == CT_LABEL and record.source_sha256 == fp["settings"]["model_sha256"]
    out = qg.evaluate(model, qg.tokenizer(folder), "quantgate_ppl", limit=3).to_json()
    assert out["settings"]["source_sha256"] == fp["settings"]["model_sha256"]
    (ckpts["root"] / "ev_sidecar").mkdir()
    (ckpts["root"] / "ev_sidecar" / "eval.json").write_text(json.dumps(out))
    from quantgate.study.compare import compare

    table = compare([ckpts["fp_eval"], ckpts["root"] / "ev_sidecar"])
    row = next(line for line in table.splitlines() if CT_LABEL in line)
    paired = paired_delta(fp["documents"]["quantgate_ppl"], out["documents"]["quantgate_ppl"], "word_perplexity")
    short = fp["settings"]["model_sha256"][:12]
    assert f"float (source sha256 {short}) |" in row and f"| {format_delta(paired)} |" in row
