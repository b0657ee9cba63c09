"""Schemes as typed configs: one class per backend with its own options and one registered handler;
strings parse to a config and print back; a new torchao config is one row."""

import dataclasses
from typing import cast

import pytest
import torch
from transformers import LlamaForCausalLM

import quantgate as qg
from quantgate.quant import schemes
from quantgate.quant.schemes import (
    SCHEMES,
    BnbScheme,
    Scheme,
    SimulatedScheme,
    TorchaoScheme,
    TorchaoStaticScheme,
    get_scheme,
    handler_for,
)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 8192, (2, 16), generator=g)} for _ in range(n)]


@pytest.mark.parametrize(
    "text, cls",
    [
        ("w8a8-int8-bondarenko:a_bits=5,gates=true", SimulatedScheme),
        ("torchao-int8-dynamic:keep=model.layers.0*", TorchaoScheme),
        ("torchao-int8-static:calib=3", TorchaoStaticScheme),
        ("llm-int8:threshold=0.0", BnbScheme),
    ],
)
def test_a_string_parses_to_its_backends_config_and_prints_back(text, cls):
    s = get_scheme(text)
    assert type(s) is cls and str(s) == text and get_scheme(str(s)) == s


@pytest.mark.parametrize(
    "text, option",
    [
        ("llm-int8:calib=4", "calib"),
        ("torchao-int8-dynamic:rotate=online", "rotate"),
        ("torchao-int8-static:a_bits=6", "a_bits"),
        ("w8a8-int8-static:threshold=3", "threshold"),
    ],
)
def test_each_config_takes_only_its_own_options(text, option):
    with pytest.raises(ValueError, match=f"unknown option '{option}="):
        get_scheme(text)


def test_calibration_is_the_configs_to_say():
    need = {name for name, s in SCHEMES.items() if s.needs_calibration}
    assert need == {
        "w8a8-int8-static",
        "w8a8-int8-bondarenko",
        "w16a8-int8-bondarenko",
        "w8a8-fp8-e4m3",
        "w8a8-fp8-e5m2",
        "w4a4-fp4-e2m1",
        "torchao-int8-static",
    }
    assert not get_scheme("w8a8-fp8-e4m3:dynamic=true").needs_calibration
    # SmoothQuant and keep=auto read calibration batches even where the activation ranges are dynamic
    assert get_scheme("torchao-int8-dynamic:smooth=0.5").needs_calibration
    assert get_scheme("w8a8-int8-dynamic:keep=auto").needs_calibration


def test_a_new_torchao_config_is_one_row(registries, tmp_path):
    """A scheme added to SCHEMES with any torchao.quantization config class quantizes, saves and loads
    through the registered torchao handler, with no other change."""
    row = TorchaoScheme(
        "my-int8-weights", "torchao Int8WeightOnlyConfig under another name", config="Int8WeightOnlyConfig"
    )
    registries(SCHEMES).add(row.name, row)
    model = qg.build("tiny-llama", seed=0).eval()
    q = cast(LlamaForCausalLM, qg.quantize(model, "my-int8-weights:keep=model.layers.1*"))
    reference = qg.quantize(model, "torchao-int8-weight-only:keep=model.layers.1*")
    ids = _batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(q(ids).logits, reference(ids).logits)
        assert type(q.model.layers[0].mlp.up_proj.weight) is not torch.nn.Parameter  # a torchao tensor
        assert type(q.model.layers[1].mlp.up_proj.weight) is torch.nn.Parameter  # kept in float
    qg.save(q, tmp_path / "q")
    again = qg.load(tmp_path / "q")
    record = qg.quantization_of(again)
    assert record is not None and record.scheme == "my-int8-weights:keep=model.layers.1*"
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)


def test_a_config_class_without_a_handler_names_the_registration():
    @dataclasses.dataclass(frozen=True)
    class Odd(Scheme):
        pass

    with pytest.raises(TypeError, match=r"@handles\(Odd"):
        handler_for(Odd("odd", "no backend"))

    @dataclasses.dataclass(frozen=True)
    class Mine(TorchaoStaticScheme):
        pass

    # a subclass of a registered config takes its nearest registered base's handler
    assert handler_for(Mine("mine", "a static int8 variant")) is schemes.HANDLERS[TorchaoStaticScheme]
    assert schemes.HANDLERS[TorchaoStaticScheme] is not schemes.HANDLERS[TorchaoScheme]
