"""Build, save and load models with their attention variant.

``save`` writes a transformers checkpoint (config.json + safetensors) whose config carries the
variant, so ``load`` rebuilds the same gated model. Plain transformers checkpoints load too, with
or without a variant, and so do checkpoints in the layout of Qiu et al.'s gated Qwen3 models
(q_proj emitting the gate). Weights are read from safetensors only, never with pickle.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import InputError, MissingFile
from ..variants import AttentionVariant, GateSpec, VariantLike
from .families import Family, config_of, family_of, get_family
from .presets import check_config_values, get_preset, preset_config
from .record import checked_record, drop_record, set_record
from .sources import (
    QUANTGATE_MODEL_TYPE,
    RESTORE_CONFIG,
    read_json_object,
    refuse_remote_code,
    resolve,
)
from .sources import tokenizer as get_tokenizer
from .swap import apply_variant, attention_modules, gate_parameters, variant_of

__all__ = [
    "build",
    "save",
    "load",
    "read_config",
    "read_safetensors",
    "read_safetensors_with_metadata",
    "QUANTGATE_MODEL_TYPE",
    "mark_quantgate_only",
    "DTYPES",
    "Placement",
    "DEVICE_MAPS",
    "offloaded",
    "meta_model",
]

log = logging.getLogger("quantgate")
# the dtypes a model loads, runs and is evaluated in, by name (the quantizers compute in float32 whatever it is)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's named device maps


@dataclass(frozen=True)
class Placement:
    """Where a loaded model's weights go, by accelerate's big-model loading (transformers' ``device_map``):
    ``device_map`` is "auto" (balanced over the GPUs, then the CPU, then disk), "balanced", "sequential" or
    {module name: device, "cpu" or "disk"}; ``max_memory`` caps each device ({0: "70GiB", "cpu": "200GiB"});
    ``offload_folder`` holds the weights mapped to "disk", read back module by module as the forward
    reaches them. The model is then as transformers dispatches it: each block runs where its weights are."""

    device_map: str | dict[str, str | int] | None = None
    max_memory: dict[str | int, str | int] | None = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_memory, dict):  # a study file's YAML keys arrive as text: "0" is GPU 0
            gpus = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in self.max_memory.items()}
            object.__setattr__(self, "max_memory", gpus)
        if self.device_map is None and (self.max_memory or self.offload_folder):
            raise InputError("max_memory and offload_folder place a model by a device_map: give --device-map auto")
        if isinstance(self.device_map, str) and self.device_map not in DEVICE_MAPS:
            raise InputError(f"device_map {self.device_map!r}: one of {', '.join(DEVICE_MAPS)}, or a JSON object")
        devices = self.device_map.values() if isinstance(self.device_map, dict) else ()
        if isinstance(self.device_map, dict) and not (
            devices and all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in devices)
        ):
            raise InputError(
                f"device_map {self.device_map!r}: map module names to devices (a GPU index, 'cpu' or 'disk')"
            )
        if self.max_memory is not None and not isinstance(self.max_memory, dict):
            raise InputError(f"max_memory {self.max_memory!r}: map devices to sizes, e.g. {{0: 70GiB, cpu: 200GiB}}")
        for d in devices:
            _check_device(d, f"device_map {self.device_map!r}")
        if devices and all(d == "disk" for d in devices):
            raise InputError(
                f"device_map {self.device_map!r} puts the whole model on disk, where nothing computes (its weights "
                f"are read back into a module only as the forward reaches it): map the modules that run to 'cpu' or a "
                f"GPU, or use --device-map auto with --max-memory"
            )
        for device, size in (self.max_memory or {}).items():
            if device != "disk":
                _check_device(device, f"max_memory {self.max_memory!r}")
            _bytes(size, f"max_memory {self.max_memory!r}: {device}")

    def described(self) -> str:
        """The placement as the command line gives it: device_map auto with max_memory cpu=1GiB."""
        device_map = json.dumps(self.device_map) if isinstance(self.device_map, dict) else self.device_map
        memory = f" with max_memory {_memory_text(self.max_memory)}" if self.max_memory else ""
        return f"device_map {device_map}{memory}"

    def kwargs(self) -> dict:
        """from_pretrained's arguments for this placement."""
        given = {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": self.offload_folder}
        return {k: v for k, v in given.items() if v is not None}


def _check_device(device: object, what: str) -> None:
    """Raise a one-line ValueError unless ``device`` names a device a placement can use: a GPU index, 'cpu',
    'disk' or a torch device name ('cuda:1', 'mps')."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return
    if isinstance(device, str) and device != "meta":
        try:
            if device == "disk" or torch.device(device).type != "meta":
                return
        except RuntimeError:
            pass
    raise InputError(f"{what}: {device!r} is no device; give a GPU index (0, 1, ...), 'cpu' or 'disk'")


def _bytes(size: object, what: str) -> int:
    """``size`` ("70GiB", "1.5GB", a number of bytes) in bytes, refused in one line where it is none."""
    from accelerate.utils import convert_file_size_to_int  # accelerate: transformers' big-model loading

    try:
        value = convert_file_size_to_int(size) if not isinstance(size, bool) else -1
    except (ValueError, TypeError, AttributeError):  # accelerate's refusal of what it cannot read as a size
        value = -1
    if not isinstance(value, int) or value < 0:
        raise InputError(f"{what}: {size!r} is no size; give a size with its unit, e.g. 70GiB or 512MB")
    return value


def _size_text(n: int) -> str:
    """``n`` bytes or more, in the largest binary unit that keeps a number >= 1 (KiB at least), to a tenth."""
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s or u == "KiB")
    return f"{math.ceil(n * 10 / scale) / 10:g}{unit}"


def offloaded(model: nn.Module) -> list[str]:
    """The parameters of ``model`` that are not in memory (placed on "disk" by a device_map: on meta)."""
    return [name for name, p in model.named_parameters() if p.device.type == "meta"]


def build(
    preset: str,
    variant: VariantLike = None,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    **config_overrides: object,
) -> nn.Module:
    """A freshly initialised model of a named preset with ``variant`` swapped in.

    ``config_overrides`` replace preset config fields (e.g. ``num_hidden_layers=4``).
    """
    preset_ = get_preset(preset)
    family = get_family(preset_.family)
    config = preset_config(preset, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = family.model_class()(config)
        apply_variant(model, variant, backend=backend)
    set_record(model, tokenizer=preset_.tokenizer)
    config_of(model)._name_or_path = preset
    return model.to(dtype) if dtype is not None else model


VARIANT_WEIGHTS = "quantgate.safetensors"  # the variant's own parameters (gates, sinks), beside the base weights
VARIANT_KEY = "quantgate_variant"  # its header's record of the variant they belong to (config.json's quantgate.variant)
# A model transformers lacks (gated, clipped, sinks) keeps its base weights under transformers' weights-variant name
# "quantgate" (model.quantgate.safetensors, or model.quantgate-0000i-of-0000n.safetensors and
# model.safetensors.index.quantgate.json), never model.safetensors: plain transformers (lm-eval's hf model, ...) looks
# for model.safetensors and refuses the folder ("no file named model.safetensors") under any model_type, also where
# config.json's model_type quantgate was edited back to the base model's, which would otherwise load it ungated.
WEIGHTS_VARIANT = "quantgate"
QUANTGATE_ONLY = "quantgate-only"  # config.json's attn_implementation in a checkpoint only quantgate loads
GATED_WEIGHTS = f"model.{WEIGHTS_VARIANT}.safetensors"
_INDEXES = ("model.safetensors.index.json", f"model.safetensors.index.{WEIGHTS_VARIANT}.json")


def save(
    model: nn.Module,
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` to directory ``path``: a transformers checkpoint of the base weights whose
    config.json names the variant (a model transformers lacks under the weights name :data:`GATED_WEIGHTS`,
    which plain transformers does not read), quantgate.safetensors with the gate and sink parameters, and the
    tokenizer (``tokenizer``, else the one the model was built or loaded with) so the directory is
    self-contained. ``weights`` (name -> tensor, whole): the weights to write where ``model`` holds only
    its shard of them (FSDP); by default its own state dict."""
    if variant_of(model) is None:
        apply_variant(model)  # record the model's own attention so the saved config names it
    path = Path(path)
    state = weights if weights is not None else model.state_dict()
    extra = {k: state[k] for k in gate_parameters(model)}
    base = {k: v for k, v in state.items() if k not in extra}
    variant = variant_of(model)
    gated = variant is not None and not variant.is_vanilla
    cast(PreTrainedModel, model).save_pretrained(path, state_dict=base, variant=WEIGHTS_VARIANT if gated else None)
    _remove_other_layout(path, gated)
    save_file(
        {k: p.detach().contiguous() for k, p in extra.items()},
        str(path / VARIANT_WEIGHTS),
        metadata={"format": "pt", VARIANT_KEY: str(variant)},
    )
    if gated:
        mark_quantgate_only(path, f"its attention is {variant}, which transformers' {type(model).__name__} lacks")
    if tokenizer is None:
        try:
            tokenizer = get_tokenizer(model)
        except (InputError, MissingFile, ModuleNotFoundError) as e:  # none known, or a library to install
            log.warning("saved %s without a tokenizer: %s", path, e)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load(
    source: str | Path,
    variant: VariantLike = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    seed: int = 0,
    placement: Placement | None = None,
) -> nn.Module:
    """Load a model: a directory written by :func:`save` or by transformers, a packaged checkpoint
    (``smollm2-135m``, ``minilm-l6``) or, online, a Hugging Face hub id; ``placement`` shards it over devices
    (and CPU or disk) in ``dtype`` as it loads (:class:`Placement`).

    ``variant`` swaps a variant into an ungated checkpoint; new gate parameters are initialised
    (with ``seed``) and listed in the log. A checkpoint saved with a gate loads with that gate. The
    weights of a checkpoint written by :func:`save` must fit the model its config.json describes
    exactly: a tensor it does not use, or one it lacks, is an error (its config.json was edited).
    """
    path = resolve(source)
    config = read_config(path)
    from ..quant.imported import check_installed  # import cycle: quant imports this package

    check_installed(config, path)  # another tool's quantization_config without its package: one line, its pip command
    family = family_of(config)
    _weight_files(path)  # fail early, and never fall back to pickled weights
    qiu = qiu_variant(config) if variant_of(config) is None else None  # Qiu et al.'s layout: its gate
    saved = qiu if qiu is not None else variant_of(config)
    target = AttentionVariant.parse(variant) if variant is not None else saved
    if saved is not None and target is not None and saved != target and not saved.is_vanilla:
        raise InputError(
            f"{path} holds a model with variant {saved}; it cannot be loaded as {target}. "
            f"Load it without variant=, or start from an ungated checkpoint"
        )
    config = copy.deepcopy(config)
    task = drop_record(config).task  # the data it was trained on, if synthetic
    if placement is not None and qiu is not None:
        raise InputError(f"{path} is in Qiu et al.'s gated layout, which loads whole: load it without --device-map")
    if qiu is not None:
        model = _load_qiu(family, path, config, qiu, seed)
    else:
        gates = path / VARIANT_WEIGHTS
        gated = saved is not None and not saved.is_vanilla
        state: dict[str, torch.Tensor] = {}
        if gated:  # before the base weights load: an edited variant is refused first
            state, header = read_safetensors_with_metadata(gates)
            _check_saved_variant(path / "config.json", cast(AttentionVariant, saved), gates, header)
        model = _from_pretrained(family, path, config, strict=saved is not None, placement=placement, dtype=dtype)
        on_disk = offloaded(model) if placement is not None else []
        if on_disk and not (target is None or target.is_vanilla):
            raise InputError(
                f"{path}: {len(on_disk)} weights were placed on disk, and the {target} variant's gates "
                f"live beside each attention's output projection: give max_memory room for the model on the GPUs "
                f"and CPU (no disk), or load it without a variant"
            )
        if gated:
            apply_variant(model, saved, seed=seed, announce=False)  # the saved gate values replace the new ones
            checked = check_state(model, state, gates, only=gate_parameters(model), decided_by=_VARIANT_FIELD)
            model.load_state_dict(checked, strict=False)
        elif gates.is_file():  # a vanilla model has no gate weights to take
            model.load_state_dict(check_state(model, read_safetensors(gates), gates, only={}), strict=False)
    apply_variant(model, target, backend=backend, seed=seed)
    if task is not None:
        set_record(model, task=task)
    model.eval()
    return model.to(dtype) if dtype is not None and placement is None else model  # placed: loaded in dtype


_VARIANT_FIELD = "its field 'quantgate.variant', which decides the gate tensors"


def _check_saved_variant(config: Path, saved: AttentionVariant, gates: Path, header: Mapping[str, str]) -> None:
    """Raise ValueError when config.json's variant is not the one the gate weights in ``gates`` were saved
    with (:func:`save` records it in their header; files written before it did are checked by their tensors'
    names and shapes alone). An edited variant whose tensors happen to fit would load and compute another model."""
    recorded = header.get(VARIANT_KEY)
    if recorded is None:
        return
    try:
        same = AttentionVariant.parse(recorded) == saved
    except InputError:
        same = False
    if not same:
        raise InputError(
            f"{config}: field 'quantgate.variant' is {str(saved)!r} but {gates} holds the gate weights of "
            f"{recorded!r}: {_RESTORE_WEIGHTS_CONFIG}"
        )


def mark_quantgate_only(path: Path, why: str) -> None:
    """Make the checkpoint in ``path`` one that transformers, lm-eval and vLLM refuse instead of building a
    different model: config.json's ``model_type`` becomes ``quantgate`` (which transformers does not know:
    "model type `quantgate` ... does not recognize this architecture"); the real one moves into the
    quantgate record, with ``why``, and :func:`read_config` reads it back. Its ``attn_implementation`` becomes
    :data:`QUANTGATE_ONLY`, an attention transformers does not have (nor quantgate registers), so a config.json
    whose model_type was edited back to the base model's is still refused by a plain load, whatever ``variant=``
    names the weights."""
    file = path / "config.json"
    data = json.loads(file.read_text())
    if data.get("model_type") == QUANTGATE_MODEL_TYPE:
        return
    record = checked_record(data, file, RESTORE_CONFIG)
    data["quantgate"] = dataclasses.replace(
        record,
        model_type=data["model_type"],
        load_with=f"quantgate (pip install quantgate; quantgate.load(DIR)): {why}",
    ).to_json()
    data["model_type"] = QUANTGATE_MODEL_TYPE
    data["attn_implementation"] = QUANTGATE_ONLY  # an edited model_type still fails: no such attention
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _weights_variant(path: Path) -> str | None:
    """transformers' weights-variant name of the base weights in ``path``: :data:`WEIGHTS_VARIANT` where
    :func:`save` wrote a model transformers lacks, else None (model.safetensors; gated checkpoints saved before
    included)."""
    gated = (path / GATED_WEIGHTS).is_file() or (path / _INDEXES[1]).is_file()
    return WEIGHTS_VARIANT if gated else None


def _remove_other_layout(path: Path, gated: bool) -> None:
    """Remove the base weights of the other layout (model.safetensors where a gated model was saved, and the
    reverse) left by an earlier save into ``path``, which a reader would otherwise take for this model's."""
    stem, index = ("model", _INDEXES[0]) if gated else (f"model.{WEIGHTS_VARIANT}", _INDEXES[1])
    for f in [path / index, *path.glob(f"{stem}.safetensors"), *path.glob(f"{stem}-*-of-*.safetensors")]:
        f.unlink(missing_ok=True)


def read_config(path: Path) -> PreTrainedConfig:
    """The transformers config of a checkpoint directory (``model_type: quantgate`` ones included:
    :func:`mark_quantgate_only`), with clear errors."""
    file = path / "config.json"
    if not file.is_file():
        raise MissingFile(
            f"{path} has no config.json: point to a directory written by qg.save or transformers' save_pretrained"
        )
    data = read_json_object(file)
    record = checked_record(data, file, RESTORE_CONFIG)
    refuse_remote_code(path)  # before transformers reads the folder, also where the caller did not resolve() it
    try:  # before transformers' own KeyError, or a NaN loss from a negative eps
        check_config_values(str(file), data, heads=True)
    except InputError as e:  # one line naming the file and field
        raise InputError(f"{e}; {RESTORE_CONFIG}") from None
    build: Callable[[], PreTrainedConfig]
    if data.get("model_type") == QUANTGATE_MODEL_TYPE:
        base = record.model_type
        if base is None or base not in CONFIG_MAPPING:
            raise InputError(
                f"cannot read {file}: its model_type is {QUANTGATE_MODEL_TYPE!r} and field 'quantgate.model_type' "
                f"names {base!r}, which transformers does not know; {RESTORE_CONFIG}"
            )
        meta = dataclasses.replace(record, model_type=None, load_with=None).to_json()
        fields = {k: v for k, v in data.items() if k != "attn_implementation"}  # quantgate sets its attention
        build = functools.partial(CONFIG_MAPPING[base].from_dict, {**fields, "model_type": base, "quantgate": meta})
    elif data.get("attn_implementation") == QUANTGATE_ONLY:
        raise InputError(
            f"cannot read {file}: its model_type was changed from {QUANTGATE_MODEL_TYPE!r} to "
            f"{data.get('model_type')!r}, which would load it without what transformers lacks "
            f"({record.load_with or 'its gate'}); {RESTORE_CONFIG}"
        )
    else:
        build = functools.partial(AutoConfig.from_pretrained, path, trust_remote_code=False)
    try:
        return build()
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' refusal of a config it cannot build
        raise InputError(f"cannot read {file}: {' '.join(str(e).split())}") from None


def _weight_files(path: Path) -> list[Path]:
    index = next((path / i for i in reversed(_INDEXES) if (path / i).is_file()), path / _INDEXES[0])
    if index.is_file():
        shards = read_json_object(index).get("weight_map")  # which shard holds each tensor
        if not isinstance(shards, dict) or not all(isinstance(s, str) for s in shards.values()):
            raise InputError(f"corrupt shard index {index}: its weight_map is not an object of file names; {_REFETCH}")
        return [path / s for s in sorted(set(shards.values()))]
    files = sorted(p for p in path.glob("*.safetensors") if p.name != VARIANT_WEIGHTS)
    if files:
        return files
    pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    hint = (
        f" It has {', '.join(pickled)}: quantgate never unpickles weights; convert them once with "
        f"transformers (from_pretrained + save_pretrained(safe_serialization=True)) where you trust the file."
        if pickled
        else ""
    )
    raise MissingFile(f"{path} has no *.safetensors weights.{hint}")


_INCOMPLETE = "the checkpoint is incomplete; re-save it with qg.save"
_REFETCH = "re-save or re-download the checkpoint"
_DECIDED_BY = "its variant, family or sizes"  # the config.json fields that decide which tensors a model has
_RESTORE_WEIGHTS_CONFIG = "restore the config.json saved with these weights, or save the model again"


def read_safetensors_with_metadata(
    path: Path, *, incomplete: str = _INCOMPLETE, fix: str = _REFETCH
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of the safetensors file ``path`` and its header metadata (``{}`` when it has none),
    never unpickling anything. A missing file is a FileNotFoundError (``{path} is missing: {incomplete}``),
    an unreadable one an InputError naming the file, saying it is corrupt or truncated and how to ``fix`` it."""
    if not path.is_file():
        raise MissingFile(f"{path} is missing: {incomplete}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
            metadata: dict[str, str] = fh.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise InputError(f"cannot read {path}: {e}. The file is corrupt or truncated; {fix}") from None
    return tensors, metadata


def read_safetensors(path: Path, *, incomplete: str = _INCOMPLETE, fix: str = _REFETCH) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, with the errors of :func:`read_safetensors_with_metadata`."""
    return read_safetensors_with_metadata(path, incomplete=incomplete, fix=fix)[0]


def _header_shapes(path: Path) -> dict[str, list[int]]:
    """The shape of every tensor in the safetensors file ``path``, from its header (no tensor is read); ``{}``
    for a file that has none (corrupt or truncated: the load that follows says so)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {key: list(fh.get_slice(key).get_shape()) for key in fh.keys()}
    except (SafetensorError, OSError):
        return {}


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of ``files`` (a checkpoint's weight shards) in one state dict."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f))
    return state


S = TypeVar("S", bound=Mapping[str, torch.Tensor])


def check_state(
    model: nn.Module,
    state: S,
    where: Path,
    only: Mapping[str, object] | None = None,
    *,
    decided_by: str = _DECIDED_BY,
) -> S:
    """``state`` (read from ``where``), once every key of ``only`` (default: ``model``'s whole state dict) is
    covered by it and every tensor of it used and of the shape the model has; to load with
    ``model.load_state_dict(..., strict=False)``. Otherwise a one-line ValueError names the tensors and says
    config.json (``decided_by``: the fields that built the model's tensors) disagrees with the weights."""
    own = model.state_dict()
    expected = set(only if only is not None else own)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = {k for k in expected - set(state) if not (k in params and id(params[k]) in loaded)}
    _check_fit(where, missing, set(state) - set(own), decided_by)
    _check_shapes(where, {k: t.shape for k, t in state.items()}, own, decided_by)
    return state


def _check_shapes(
    where: Path, shapes: Mapping[str, Sequence[int]], own: Mapping[str, torch.Tensor], decided_by: str
) -> None:
    """Raise a one-line ValueError naming the tensors of the weights at ``where`` (``shapes``: name -> shape)
    whose shapes differ from the model's tensors ``own`` of the same name."""
    wrong = sorted(k for k, shape in shapes.items() if k in own and tuple(shape) != tuple(own[k].shape))
    if wrong:
        listed = ", ".join(f"{k} is {list(shapes[k])}, the model's {list(own[k].shape)}" for k in wrong[:2])
        raise InputError(
            f"{where} holds {len(wrong)} tensor{'s' if len(wrong) > 1 else ''} of other shapes than the model "
            f"built from config.json "
            f"({listed}{', ...' if len(wrong) > 2 else ''}): config.json ({decided_by}) disagrees with the "
            f"weights; {_RESTORE_WEIGHTS_CONFIG}"
        )


def _check_fit(where: Path | str, missing: set[str], unused: set[str], decided_by: str = _DECIDED_BY) -> None:
    """Raise ValueError naming a few of the ``missing`` and ``unused`` tensors of the weights at ``where``."""
    if not (missing or unused):
        return

    def few(keys: set[str]) -> str:
        names = sorted(keys)
        return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

    parts = (
        [f"holds {len(unused)} tensors the model built from config.json does not use ({few(unused)})"] if unused else []
    )
    parts += [f"lacks {len(missing)} tensors it needs ({few(missing)})"] if missing else []
    raise InputError(
        f"{where} {' and '.join(parts)}: config.json ({decided_by}) disagrees with "
        f"the weights, or the checkpoint is incomplete; {_RESTORE_WEIGHTS_CONFIG}"
    )


def _gpu_index(device: str | int) -> int | None:
    """The CUDA index a placement's ``device`` names (0 for 'cuda'), None for 'cpu', 'disk', 'mps'."""
    if isinstance(device, int):
        return device
    if device == "disk":
        return None
    named = torch.device(device)
    return (named.index or 0) if named.type == "cuda" else None


def _check_placement(family: Family, config: PreTrainedConfig, placement: Placement, dtype: torch.dtype | None) -> None:
    """Refuse, in one line and before anything loads, a placement this machine or model cannot run: a GPU the
    machine lacks; a named device map (auto, ...) whose max_memory leaves every module on disk, where nothing
    computes (naming the smallest max_memory that places one); one that puts modules on disk without an
    offload_folder. The device map is the one from_pretrained computes (transformers' own planner, on the model's
    shapes as meta tensors, in the dtype it loads in)."""
    gpus = torch.cuda.device_count()
    mapped = placement.device_map.values() if isinstance(placement.device_map, dict) else ()
    for device in [*mapped, *(placement.max_memory or {})]:
        index = _gpu_index(device)
        if index is not None and index >= gpus:
            raise InputError(
                f"{placement.described()} uses GPU {index}, and this machine has {gpus} GPU(s): "
                + ("place the model on 'cpu' (and 'disk')" if not gpus else f"use GPUs 0 to {gpus - 1}")
            )
    if not isinstance(placement.device_map, str):
        return
    from transformers.integrations.accelerate import _get_device_map  # the planner from_pretrained calls

    skeleton = cast(PreTrainedModel, meta_model(family, config).to(dtype or torch.get_default_dtype()))

    def planned(max_memory: Mapping[str | int, str | int] | None) -> dict[str, str | int]:
        return dict(_get_device_map(skeleton, placement.device_map, dict(max_memory) if max_memory else None, None))

    device_map = planned(placement.max_memory)
    if set(device_map.values()) == {"disk"}:
        caps: dict[str | int, str | int] = dict(placement.max_memory or {})
        device = next((d for d in caps if isinstance(d, int) and d < gpus), "cpu")  # the first GPU named, else cpu
        total = sum(t.numel() * t.element_size() for t in [*skeleton.parameters(), *skeleton.buffers()])
        low, high = 0, 2 * total + 2**20

        def places(size: int) -> bool:  # whether some module stays off disk with ``size`` bytes on the device
            return set(planned({**caps, device: size}).values()) != {"disk"}

        if places(high):
            while high - low > max(high // 200, 2**10):  # to half a percent
                middle = (low + high) // 2
                low, high = (low, middle) if places(middle) else (middle, high)
            fix = f"give {device} at least {_size_text(high)}"
        else:
            fix = "give a compute device room for one block"
        raise InputError(
            f"max_memory (--max-memory) {_memory_text(placement.max_memory)} leaves no room for any of the model's "
            f"modules on {device} (accelerate also keeps room there for its largest block), so every weight would "
            f"go to disk, where nothing computes: {fix}"
        )
    on_disk = [name or "the whole model" for name, d in device_map.items() if d == "disk"]
    if on_disk and placement.offload_folder is None:
        raise InputError(
            f"{placement.described()} puts {len(on_disk)} module(s) on disk ({', '.join(on_disk[:3])}"
            f"{', ...' if len(on_disk) > 3 else ''}): give offload_folder (--offload-folder) a folder for their "
            f"weights, or max_memory more room"
        )


def meta_model(family: Family, config: PreTrainedConfig) -> nn.Module:
    """The family's model for ``config`` on the meta device: its shapes (and dtype) without its memory."""
    with torch.device("meta"):
        return family.model_class(config)(copy.deepcopy(config))


def _memory_text(max_memory: Mapping[str | int, str | int] | None) -> str:
    """``max_memory`` as --max-memory writes it: 0=70GiB,cpu=200GiB."""
    return ",".join(f"{k}={v}" for k, v in (max_memory or {}).items())


def _from_pretrained(
    family: Family,
    path: Path,
    config: PreTrainedConfig,
    strict: bool,
    placement: Placement | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """transformers' from_pretrained; ``strict`` (checkpoints written by :func:`save`): the weights must fit
    the model exactly. Other checkpoints may carry heads the model does not use (transformers warns), but
    never lack a tensor the model needs (transformers would initialise it at random: a config.json whose
    ``num_hidden_layers`` was raised by hand loads with random extra blocks). Tensors
    of another shape than config.json gives them are refused first, naming them (transformers' own refusal
    names none and prints a table). Not for another tool's quantized weights, whose packed tensors have other
    shapes by design."""
    if getattr(config, "quantization_config", None) is None:
        skeleton = meta_model(family, config).state_dict()
        for file in _weight_files(path):
            _check_shapes(file, _header_shapes(file), skeleton, "its sizes")
    placed = {} if placement is None else {**placement.kwargs(), **({"dtype": dtype} if dtype is not None else {})}
    if placement is not None:  # before anything loads, or is written to the offload folder
        _check_placement(family, config, placement, dtype)
    try:
        loaded = family.model_class(config).from_pretrained(
            path,
            config=config,
            use_safetensors=True,
            variant=_weights_variant(path),
            output_loading_info=True,
            trust_remote_code=False,
            **placed,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # transformers' refusal of the weights
        if placement is not None and not isinstance(e, SafetensorError):  # the placement failed, not the weights
            raise InputError(
                f"cannot place {path} as {placement.described()} asks: {' '.join(str(e).split())}; fix the placement"
            ) from None
        raise InputError(
            f"cannot load {path}: {e}. The weights are corrupt, truncated or do not match config.json"
        ) from None
    # with output_loading_info, from_pretrained (typed as returning the model) returns (model, info)
    model, info = cast(tuple[PreTrainedModel, dict[str, list[str]]], loaded)
    if placement is not None and set(getattr(model, "hf_device_map", {}).values()) == {"disk"}:
        raise InputError(f"{placement.described()} put every weight of {path} on disk, where nothing computes")
    files = _weight_files(path)
    _check_fit(
        files[0] if len(files) == 1 else f"{path} ({len(files)} weight shards)",
        set(info["missing_keys"]),
        set(info["unexpected_keys"]) if strict else set(),
    )
    return model


# --- Qiu et al.'s gated Qwen3 layout: q_proj emits [queries | gates] per key/value group ----------


def qiu_variant(config: PreTrainedConfig) -> AttentionVariant | None:
    if getattr(config, "model_type", None) != "qwen3":
        return None
    if getattr(config, "headwise_attn_output_gate", False):
        return AttentionVariant(gate=GateSpec("g1-headwise", 0.5))
    if getattr(config, "elementwise_attn_output_gate", False):
        return AttentionVariant(gate=GateSpec("g1-elementwise", 0.5))
    return None


def _load_qiu(family: Family, path: Path, config: PreTrainedConfig, variant: AttentionVariant, seed: int) -> nn.Module:
    if getattr(config, "qkv_bias", None) not in (None, getattr(config, "attention_bias", False)):
        config.attention_bias = config.qkv_bias
    model = family.model_class(config)(config)
    if getattr(config, "use_qk_norm", True) is False:  # Qiu et al.'s configs can switch QK-norm off
        for attn in attention_modules(model):
            attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()
    apply_variant(model, variant, seed=seed, announce=False)  # the checkpoint's gate values replace the new ones
    state = _split_qiu_q_proj(_read_safetensors(_weight_files(path)), model, family)
    model.load_state_dict(check_state(model, state, path), strict=False)
    return model


def _split_qiu_q_proj(state: Mapping[str, torch.Tensor], model: nn.Module, family: Family) -> dict[str, torch.Tensor]:
    """Rewrite each fused q_proj (Hkv groups of [G*D query rows | G*g gate rows]) into q_proj + gate.proj."""
    dims = family.dims(config_of(model))
    groups, d = dims.n_heads // dims.n_kv_heads, dims.head_dim
    prefix = model.base_model_prefix
    new = dict(state)
    for i, block in enumerate(family.attention_blocks(model)):
        gate = cast(nn.Linear, block.get_submodule(f"{family.attention}.gate.proj"))
        g = gate.out_features // dims.n_heads  # 1 (headwise) or D (elementwise)
        base = f"{prefix}.{family.layers}.{i}.{family.attention}"
        for kind in ("weight", "bias"):
            key = f"{base}.q_proj.{kind}"
            if key not in new:
                if kind == "bias":
                    new[f"{base}.gate.proj.bias"] = torch.zeros(dims.n_heads * g)
                continue
            fused = new.pop(key)
            per_group = fused.reshape(dims.n_kv_heads, groups * (d + g), *fused.shape[1:])
            new[key] = per_group[:, : groups * d].reshape(dims.n_heads * d, *fused.shape[1:])
            new[f"{base}.gate.proj.{kind}"] = per_group[:, groups * d :].reshape(dims.n_heads * g, *fused.shape[1:])
    return new
