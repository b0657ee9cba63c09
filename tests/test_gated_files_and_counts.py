"""Issue 41's hostile cases on models, checkpoints and runs: a resumed run whose trainer.json data position was
edited, parameter counts of torchao exports (tied head), a gated checkpoint whose config.json was "fixed" to a
model type transformers knows, and noise (a misleading "added parameters" line, git's complaint outside a
checkout)."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_TRAIN
from transformers import AutoConfig, AutoModelForCausalLM

import quantgate as qg
from quantgate.cli import main
from quantgate.models.sources import package_dir
from quantgate.train import TrainConfig, train

IDS = torch.randint(5, 8000, (2, 24), generator=torch.Generator().manual_seed(0))
TINY: dict[str, Any] = TINY_TRAIN


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _train(out, **kw):
    model = qg.build("tiny-llama", seed=1)
    return train(model, qg.tokenizer(model), config=TrainConfig(out=str(out), **{**TINY, **kw}))


@pytest.mark.parametrize("batch", [0, 3, 7])
def test_resume_refuses_edited_data_batch(batch, tmp_path):
    """lr, step, scheduler and world_size edits are refused; so is a data position the saved step does not
    make (the resumed run would replay or skip data, and end elsewhere than a straight run)."""
    _train(tmp_path, stop_after=2)
    f = tmp_path / "checkpoints" / "step-2" / "trainer.json"
    saved = json.loads(f.read_text())
    assert saved["data"]["batch"] == 2  # two steps of one micro-batch each
    saved["data"]["batch"] = batch
    f.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"data\.batch is \d+, but .* step 2") as caught:
        _train(tmp_path, resume=True)
    assert str(f) in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "model").exists()


def test_resume_of_an_unedited_run_still_matches_a_straight_run(tmp_path):
    straight = _train(tmp_path / "a", grad_accum=2)
    _train(tmp_path / "b", grad_accum=2, stop_after=2)
    assert json.loads((tmp_path / "b/checkpoints/step-2/trainer.json").read_text())["data"]["batch"] == 4
    resumed = _train(tmp_path / "b", grad_accum=2, resume=True)
    for (name, x), y in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def _info(path, capsys) -> dict[str, str]:
    assert main(["info", str(path)]) == 0
    rows = [line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return {k: v.strip() for k, v in rows}


def test_info_counts_tied_head_once_on_torchao_export(tmp_path, capsys):
    from quantgate.models.cost import parameter_count

    model = qg.build("tiny-llama")
    n = sum(p.numel() for p in model.parameters())
    assert n == 598_336 and model.get_submodule("lm_head").weight is model.get_submodule("model.embed_tokens").weight
    q = qg.quantize(model, "torchao-int8-weight-only")
    qg.save(q, tmp_path / "ao")
    assert _info(tmp_path / "ao", capsys)["parameters"].startswith(f"{n:,} ({n:,} base + 0 gate/sink)")
    assert parameter_count(qg.load(tmp_path / "ao")) == n
    assert parameter_count(q) == n  # in memory: torchao's subclasses by their logical size
    qg.save(model, tmp_path / "float")
    assert _info(tmp_path / "float", capsys)["parameters"].startswith(f"{n:,} ")


GATED = ["g1-elementwise", "sink", "clipped:gamma=-0.025"]


def _as_llama(path: Path) -> None:
    """The obvious "fix" for transformers' unknown-architecture error: config.json's model_type llama."""
    f = path / "config.json"
    config = json.loads(f.read_text())
    assert config["model_type"] == "quantgate"
    config["model_type"] = "llama"
    f.write_text(json.dumps(config))


@pytest.mark.parametrize("variant", GATED)
def test_gated_checkpoint_with_model_type_llama_refused_by_transformers(variant, tmp_path):
    qg.save(qg.build("tiny-llama", variant=variant), tmp_path)
    _as_llama(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "llama"  # transformers reads the edited config
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_trained_gated_model_with_model_type_llama_refused_by_transformers(tmp_path):
    model = qg.build("tiny-llama", "g1-headwise", seed=1)
    train(model, qg.tokenizer(model), config=TrainConfig(out=str(tmp_path), **{**TINY, "checkpoint_every": 0}))
    _as_llama(tmp_path / "model")
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model")


def test_the_packaged_gated_twin_with_model_type_llama_refused_by_transformers(tmp_path):
    shutil.copytree(package_dir("twin-g1"), tmp_path / "twin-g1")
    _as_llama(tmp_path / "twin-g1")
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(tmp_path / "twin-g1")


def test_gated_checkpoint_still_loads_in_quantgate(tmp_path, capsys, monkeypatch):
    model = qg.build("tiny-llama", variant="g1-elementwise")
    qg.save(model, tmp_path / "g")
    assert torch.equal(_logits(qg.load(tmp_path / "g")), _logits(model))
    with pytest.raises(ValueError, match="model type `quantgate`"):  # unedited: refused naming quantgate
        AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    assert _info(tmp_path / "g", capsys)["variant"] == "g1-elementwise"
    # a save over an ungated model's folder (and back) leaves no stale weights that another reader takes
    qg.save(qg.build("tiny-llama"), tmp_path / "g")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "g")), _logits(qg.build("tiny-llama")))
    qg.save(model, tmp_path / "g")
    assert torch.equal(_logits(qg.load(tmp_path / "g")), _logits(model))
    _as_llama(tmp_path / "g")
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    # quantized in quantgate's own layout, and back
    q = qg.quantize(model, "w8a8-int8-dynamic")
    qg.save(q, tmp_path / "q")
    assert torch.equal(_logits(qg.load(tmp_path / "q")), _logits(q))
    # the packaged gated twin (saved before) still loads
    assert qg.variant_of(qg.load("twin-g1")) == qg.AttentionVariant.parse("g1-elementwise")
    # lm-eval's own command line with --model quantgate reads the gated checkpoint as quantgate eval does
    qg.save(model, tmp_path / "g2")
    out = tmp_path / "lm"
    monkeypatch.chdir(tmp_path)
    cmd = ["lm-eval", "--model", "quantgate", "--model_args", f"pretrained={tmp_path / 'g2'}"]
    cmd += ["--tasks", "quantgate_ppl", "--limit", "2", "--output_path", str(out)]
    assert main(cmd) == 0, capsys.readouterr().err[-3000:]
    (results,) = out.rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["quantgate_ppl"]["word_perplexity,none"]
    ours = qg.evaluate(qg.load(tmp_path / "g2"), tasks=["quantgate_ppl"], limit=2).results["quantgate_ppl"]
    assert theirs == pytest.approx(ours["word_perplexity"], rel=1e-3)


def test_info_no_added_parameters_message(tmp_path, capsys, caplog):
    qg.save(qg.build("tiny-llama", variant="g1-elementwise"), tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="quantgate"):
        rows = _info(tmp_path, capsys)
    assert rows["parameters"] == "606,656 (598,336 base + 8,320 gate/sink)"
    assert "new parameters" not in caplog.text + capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="quantgate"):  # a variant swapped into an ungated model: said
        qg.build("tiny-llama", variant="g1-elementwise")
    assert "added 8320 new parameters" in caplog.text


@pytest.mark.slow  # 16 s
def test_no_git_noise_outside_checkout(tmp_path):
    cmd = [sys.executable, "-m", "quantgate.cli", "eval", "tiny-llama", "--limit", "2"]
    run = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": "/"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not a git repository" not in run.stderr + run.stdout
    assert "word_perplexity" in run.stdout
