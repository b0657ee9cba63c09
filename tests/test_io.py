"""build / save / load: round trips, plain transformers checkpoints, Qiu et al.'s layout, bad input."""

import json
import shutil

import pytest
import torch
from conftest import ALL_VARIANTS, build_or_refuse

import quantgate as qg
from quantgate.models import attention_modules
from quantgate.models.families import config_of

IDS = torch.randint(5, 8192, (2, 10))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bert", "tiny-mla"])
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_save_load_is_bit_identical(tmp_path, preset, variant):
    model = build_or_refuse(preset, variant, seed=7)
    if model is None:
        return
    model.eval()
    with torch.no_grad():  # make gates and sinks differ from their initial values
        for p in qg.gate_parameters(model).values():
            p.add_(torch.randn_like(p) * 0.1)
    qg.save(model, tmp_path / "m")
    loaded = qg.load(tmp_path / "m")
    assert qg.variant_of(loaded) == qg.AttentionVariant.parse(variant)
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("preset", ["tiny-opt", "tiny-qwen3", "tiny-qwen2", "tiny-qwen3-next", "tiny-mla"])
def test_save_load_other_families(tmp_path, preset):
    variant = "g1-elementwise+sink" if preset.endswith("next") else "hyga:low_rank=4+sink"
    model = qg.build(preset, variant).eval()
    qg.save(model, tmp_path / "m")
    assert torch.equal(_logits(qg.load(tmp_path / "m")), _logits(model))


def _plain_checkpoint(path, preset="tiny-llama"):
    """A checkpoint written by transformers alone, as downloaded models are."""
    config = config_of(qg.build(preset)).to_dict()
    config.pop("quantgate")
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    model.save_pretrained(path)
    return model


def test_plain_transformers_checkpoint_loads_with_and_without_variant(tmp_path):
    hf = _plain_checkpoint(tmp_path / "hf")
    plain = qg.load(tmp_path / "hf")
    assert str(qg.variant_of(plain)) == "vanilla"
    assert torch.equal(_logits(plain), _logits(hf))
    gated = qg.load(tmp_path / "hf", variant="g1-headwise:pi_init=0.9")
    assert str(qg.variant_of(gated)) == "g1-headwise:pi_init=0.9"
    for name, p in gated.named_parameters():  # every original weight loaded unchanged
        if "gate" not in name:
            assert torch.equal(p, hf.get_parameter(name)), name
    bias = attention_modules(gated)[0].get_parameter("gate.proj.bias")
    assert torch.allclose(bias, torch.full((4,), torch.logit(torch.tensor(0.9)).item()))
    # saving the gated model and loading it again keeps the gate, and the plain dir stays loadable
    qg.save(gated, tmp_path / "gated")
    assert torch.equal(_logits(qg.load(tmp_path / "gated")), _logits(gated))


def test_vanilla_checkpoint_takes_a_gate_but_a_gated_one_keeps_its_own(tmp_path):
    qg.save(qg.build("tiny-opt"), tmp_path / "vanilla")
    assert str(qg.variant_of(qg.load(tmp_path / "vanilla", variant="bondarenko"))) == "bondarenko"
    qg.save(qg.build("tiny-opt", "g1-headwise"), tmp_path / "gated")
    with pytest.raises(ValueError, match="holds a model with variant g1-headwise; it cannot be loaded as hyga"):
        qg.load(tmp_path / "gated", variant="hyga")


def _fuse_qiu(model, headwise: bool):
    """Write q_proj + gate the way Qiu et al.'s Qwen3 stores them: per key/value group, the group's
    query rows followed by its gate rows (their forward splits q_proj(x).view(B, N, Hkv, -1))."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hq, hkv, d = 4, 2, 16
    g = hq // hkv
    for i in range(2):
        pre = f"model.layers.{i}.self_attn"
        q = state.pop(f"{pre}.q_proj.weight").view(hkv, g * d, -1)
        gw = state.pop(f"{pre}.gate.proj.weight").view(hkv, g * (1 if headwise else d), -1)
        state.pop(f"{pre}.gate.proj.bias")
        state[f"{pre}.q_proj.weight"] = torch.cat([q, gw], dim=1).reshape(-1, q.shape[-1])
    return state


@pytest.mark.parametrize("headwise", [True, False])
def test_qiu_gated_checkpoint_layout(tmp_path, headwise):
    kind = "g1-headwise" if headwise else "g1-elementwise"
    model = qg.build("tiny-qwen3", kind, seed=5).eval()
    with torch.no_grad():
        for attn in attention_modules(model):
            attn.get_parameter("gate.proj.bias").zero_()  # their q_proj has no bias (attention_bias false)
    from safetensors.torch import save_file

    out = tmp_path / "qiu"
    out.mkdir()
    save_file(_fuse_qiu(model, headwise), str(out / "model.safetensors"))
    config = config_of(model).to_dict()
    config.pop("quantgate")
    config.update(
        headwise_attn_output_gate=headwise,
        elementwise_attn_output_gate=not headwise,
        qkv_bias=False,
        use_qk_norm=True,
        architectures=["Qwen3ForCausalLM"],
    )
    (out / "config.json").write_text(json.dumps(config))
    loaded = qg.load(out)
    assert str(qg.variant_of(loaded)) == kind
    assert torch.equal(_logits(loaded), _logits(model))


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no model '.*nowhere': give a checkpoint directory"):
        qg.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is a preset"):
        qg.load("tiny-opt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        qg.load(tmp_path / "empty")
    qg.save(qg.build("tiny-opt", "g1-headwise"), tmp_path / "m")
    weights = tmp_path / "m" / "model.quantgate.safetensors"  # a gated model's base weights
    shutil.copytree(tmp_path / "m", tmp_path / "pickled")
    (tmp_path / "pickled" / "model.quantgate.safetensors").rename(tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        qg.load(tmp_path / "pickled")
    shutil.copytree(tmp_path / "m", tmp_path / "corrupt")
    data = weights.read_bytes()
    (tmp_path / "corrupt" / "quantgate.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        qg.load(tmp_path / "corrupt")
    (tmp_path / "corrupt" / "quantgate.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"quantgate\.safetensors is missing"):
        qg.load(tmp_path / "corrupt")
    shutil.copytree(tmp_path / "m", tmp_path / "broken")
    (tmp_path / "broken" / "model.quantgate.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match="cannot load"):
        qg.load(tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        qg.load(tmp_path / "broken")


def test_a_train_run_directory_loads_as_its_model(tmp_path, capsys):
    """`quantgate train --out RUN` then qg.load(RUN), `quantgate info RUN`: the run's model/, same logits."""
    from quantgate.cli import main

    run = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny-llama",
        "--variant",
        "g1-headwise",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(run),
    ]
    assert main(argv) == 0
    model, direct = qg.load(run), qg.load(run / "model")
    assert str(qg.variant_of(model)) == "g1-headwise"
    ids = torch.randint(5, 8192, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    assert main(["info", str(run)]) == 0 and "g1-headwise" in capsys.readouterr().out
    (tmp_path / "unfinished" / "checkpoints" / "step-1").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"has not finished .* --resume"):
        qg.load(tmp_path / "unfinished")
    with pytest.raises(FileNotFoundError, match=r"expected a checkpoint directory .* run directory"):
        qg.load(tmp_path)
