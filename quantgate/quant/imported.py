"""Quantization that other tools wrote, named the way quantgate names its own.

A checkpoint quantized by llm-compressor / compressed-tensors, by transformers' ``TorchAoConfig`` or
``BitsAndBytesConfig``, or by GPTQ / AWQ tools carries a ``quantization_config`` in its config.json;
transformers' HF quantizers load and run it. :func:`describe` turns that config into quantgate's
record of it (:class:`ImportedQuantization`): a short, stable label (``scheme``), e.g.
``compressed-tensors:w8a8-int8 (weights int8 channel symmetric, activations int8 token dynamic)``,
``torchao:Int8WeightOnlyConfig`` or ``bitsandbytes:llm-int8(threshold=6.0)``, the method's settings
and ``origin`` (the tool). :func:`imported_quantization` reads it from a loaded model (with what a quantgate
``quantization.json`` sidecar beside the weights says of their float source, where there is one:
:class:`Sidecar`), or, for a model without a config, names the quantized tensors it holds.

:func:`check_installed` turns the ImportError transformers raises deep in ``from_pretrained`` when the
tool's package is missing into a one-line ModuleNotFoundError naming its pip command;
:func:`dequantize_` decompresses a compressed-tensors or bitsandbytes model to float with the tool's
own code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quantgate.errors import InputError, MissingDependency
from quantgate.files import read_json
from quantgate.json_record import JsonRecord, json_field

__all__ = [
    "INSTALL",
    "ImportedQuantization",
    "Sidecar",
    "describe",
    "quantization_config",
    "imported_quantization",
    "quantized_tensors",
    "check_installed",
    "dequantize_",
]

SIDECAR = "quantization.json"  # quantgate's manifest / provenance sidecar (quantgate.quant.manifest.MANIFEST)
# per quant_method: the packages (module: pip name) transformers needs to load it, and the pip command
INSTALL: dict[str, tuple[dict[str, str], str]] = {
    "compressed-tensors": (
        {"compressed_tensors": "compressed-tensors"},
        "pip install 'compressed-tensors>=0.20.1,<0.21'",
    ),
    "torchao": ({"torchao": "torchao"}, "pip install 'torchao>=0.18,<0.19'"),
    "bitsandbytes": ({"bitsandbytes": "bitsandbytes"}, "pip install 'bitsandbytes>=0.50,<0.51'"),
    "gptq": ({"optimum": "optimum", "gptqmodel": "gptqmodel"}, "pip install optimum gptqmodel"),
    "awq": ({"gptqmodel": "gptqmodel"}, "pip install gptqmodel"),
}
_GENERIC_KEYS = ("bits", "group_size", "weight_block_size", "activation_scheme", "quant_type", "weights", "activations")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Sidecar(JsonRecord):
    """What a quantgate ``quantization.json`` in a model's folder says of the model's provenance (:func:`sidecar`),
    beside quantgate's own weights (its manifest) or another tool's (an export's sidecar): the file (``sidecar``),
    the float source's ``source_sha256`` (64 hex digits), ``source_model`` and ``source_files_sha256`` (the sha256
    of its config and weights files), and the quantgate scheme that made them (``quantgate_scheme``), each absent
    where the file lacks it or holds another type."""

    sidecar: str
    source_sha256: str | None = json_field(omit_none=True)
    source_model: str | None = json_field(omit_none=True)
    quantgate_scheme: str | None = json_field(omit_none=True)
    source_files_sha256: str | None = json_field(omit_none=True)


@dataclass(frozen=True)
class ImportedQuantization:
    """quantgate's record of a quantization another tool made: the tool (``origin``: transformers' quant method,
    or the library whose tensors the model holds), the label naming it (``scheme``), the method's ``settings``
    as read from its config (compressed-tensors' ``weights`` and ``groups``, bitsandbytes' ``bits``, ...; JSON
    values), the ``quantization_config`` itself (plain JSON; None for a model without one), the quantized tensors
    counted where there is no config (``tensors``) and what a quantgate ``sidecar`` beside the weights says."""

    origin: str
    scheme: str
    settings: dict[str, Any]
    quantization_config: dict[str, Any] | None = None
    tensors: int | None = None
    sidecar: Sidecar | None = None

    @property
    def source_model(self) -> str | None:
        """The float model it was made from, where a sidecar names it."""
        return self.sidecar.source_model if self.sidecar else None

    @property
    def source_sha256(self) -> str | None:
        """The float model's fingerprint, where a sidecar holds it."""
        return self.sidecar.source_sha256 if self.sidecar else None

    @property
    def dequantizable(self) -> bool:
        """Whether :func:`dequantize_` can turn the model back into a float one: a compressed-tensors or
        bitsandbytes model loaded with its quantization_config."""
        return self.origin in ("compressed-tensors", "bitsandbytes") and self.quantization_config is not None

    def with_origin(self) -> dict[str, Any]:
        """The record as JSON (an evaluation keeps it): ``origin``, ``scheme``, the settings at the top level, then
        ``quantization_config``, ``tensors`` and the sidecar's fields, each where there is one."""
        config = {} if self.quantization_config is None else {"quantization_config": self.quantization_config}
        counted = {} if self.tensors is None else {"tensors": self.tensors}
        found = self.sidecar.to_json() if self.sidecar else {}
        return {"origin": self.origin, "scheme": self.scheme, **self.settings, **config, **counted, **found}


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data (enums as their value, dtypes and other objects as text)."""
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value).removeprefix("torch.")


def quantization_config(config: object) -> dict | None:
    """The ``quantization_config`` of a transformers config (an object or config.json's dict) as plain
    JSON data, or None where it has none."""
    if isinstance(config, Mapping):
        qc = config.get("quantization_config")
    else:
        qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        to_dict = getattr(qc, "to_dict", None)
        qc = to_dict() if callable(to_dict) else vars(qc)
    out = _plain(qc)
    return out if out else None


def method_of(qc: Mapping) -> str:
    """The quantization method of a ``quantization_config`` dict (transformers' ``quant_method``)."""
    method = str(qc.get("quant_method") or "unknown").lower()
    return "bitsandbytes" if method in ("bitsandbytes", "bitsandbytes_8bit", "bitsandbytes_4bit") else method


def describe(qc: Mapping) -> ImportedQuantization:
    """quantgate's record of a ``quantization_config``: ``origin``, ``scheme`` (the label), the method's
    settings, and ``quantization_config`` itself (as plain JSON)."""
    plain: dict = _plain(qc)
    method = method_of(plain)
    reader = {
        "compressed-tensors": _compressed_tensors,
        "torchao": _torchao,
        "bitsandbytes": _bitsandbytes,
        "gptq": _gptq,
        "awq": _awq,
    }.get(method, _generic)
    label, fields = reader(plain)
    scheme = f"{method}:{label}" if label else method
    return ImportedQuantization(method, scheme, fields, quantization_config=plain)


# --- compressed-tensors ------------------------------------------------------------------------------


def _ct_format(args: Mapping) -> str:
    """``int8``, ``fp8``, ``fp4``: the number format of compressed-tensors QuantizationArgs."""
    return f"{'fp' if args.get('type') == 'float' else 'int'}{args.get('num_bits')}"


def _ct_strategy(args: Mapping) -> str:
    strategy = str(args.get("strategy") or "tensor")
    if strategy in ("group", "tensor_group") and args.get("group_size"):
        return f"{strategy} {args['group_size']}"
    if strategy == "block" and args.get("block_structure"):
        return f"block {'x'.join(str(b) for b in args['block_structure'])}"
    return strategy


def _ct_dynamic(args: Mapping) -> str:
    dynamic = args.get("dynamic")
    return "dynamic" if dynamic is True else "static" if not dynamic else f"{dynamic}-dynamic"


def _ct_args(args: Mapping | None) -> dict | None:
    if not args:
        return None
    keys = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure", "observer")
    return {k: args.get(k) for k in keys if k in args}


def _ct_group(group: Mapping) -> tuple[str, str]:
    """(name, details) of one config group: ``w8a8-int8``, ``weights int8 channel symmetric, activations
    int8 token dynamic``."""
    w, a, o = group.get("weights"), group.get("input_activations"), group.get("output_activations")
    wf, af = (_ct_format(w) if w else None), (_ct_format(a) if a else None)
    wb, ab = (w.get("num_bits") if w else 16), (a.get("num_bits") if a else 16)
    kinds = list(dict.fromkeys(f for f in (wf, af) if f))
    name = f"w{wb}a{ab}" + (f"-{'-'.join(kinds)}" if kinds else "")
    parts = []
    if w:
        sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
        parts.append(f"weights {wf} {_ct_strategy(w)} {sym}" + (" dynamic" if w.get("dynamic") else ""))
    for role, args in (("activations", a), ("outputs", o)):
        if args:
            sym = "" if args.get("symmetric", True) else " asymmetric"
            parts.append(f"{role} {_ct_format(args)} {_ct_strategy(args)} {_ct_dynamic(args)}{sym}")
    return name, ", ".join(parts)


def _compressed_tensors(qc: dict) -> tuple[str, dict]:
    groups = qc.get("config_groups") or {}
    labels = []
    records = []
    for key in sorted(groups):
        group = groups[key]
        name, details = _ct_group(group)
        targets = list(group.get("targets") or [])
        on = f" on {'|'.join(targets)}" if len(groups) > 1 else ""
        labels.append(f"{name} ({details}){on}" if details else name + on)
        records.append(
            {
                "name": key,
                "targets": targets,
                "weights": _ct_args(group.get("weights")),
                "input_activations": _ct_args(group.get("input_activations")),
                "output_activations": _ct_args(group.get("output_activations")),
                "format": group.get("format"),
            }
        )
    kv = qc.get("kv_cache_scheme")
    if kv:
        labels.append(f"kv-cache {_ct_format(kv)} {_ct_strategy(kv)} {_ct_dynamic(kv)}")
    first = records[0] if records else {}
    fields = {
        "format": qc.get("format"),
        "weights": first.get("weights"),
        "input_activations": first.get("input_activations"),
        "groups": records,
        "ignore": list(qc.get("ignore") or []),
        "kv_cache_scheme": _ct_args(kv),
    }
    return "; ".join(labels) or "no config groups", fields


# --- torchao, bitsandbytes, GPTQ, AWQ, others -------------------------------------------------------


def _ao_types(value: Any) -> list[str]:
    """The torchao config class names inside a serialized config (``{"_type": ..., "_data": ...}``)."""
    if isinstance(value, Mapping):
        found = [str(value["_type"])] if "_type" in value and str(value["_type"]).endswith("Config") else []
        return found + [t for v in value.values() for t in _ao_types(v)]
    if isinstance(value, list):
        return [t for v in value for t in _ao_types(v)]
    return []


def _ao_options(value: Any) -> Any:
    """A serialized torchao config as ``{"Type": {option: value}}`` / plain values, without the envelope."""
    if isinstance(value, Mapping) and "_type" in value:
        data = value.get("_data")
        return {str(value["_type"]): _ao_options(data)} if data is not None else str(value["_type"])
    if isinstance(value, Mapping):
        return {k: _ao_options(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ao_options(v) for v in value]
    return value


def _torchao(qc: dict) -> tuple[str, dict]:
    quant_type = qc.get("quant_type")
    if isinstance(quant_type, str):  # the legacy string form: "int8_weight_only"
        label, configs = quant_type, [quant_type]
    elif isinstance(quant_type, Mapping) and set(quant_type) == {"default"}:
        configs = list(dict.fromkeys(_ao_types(quant_type["default"])))
        label = configs[0] if len(configs) == 1 else f"{configs[0]}({', '.join(configs[1:])})" if configs else "?"
    elif isinstance(quant_type, Mapping):  # per module: {fqn: config}
        configs = list(dict.fromkeys(_ao_types(quant_type)))
        label = ", ".join(f"{k}={'|'.join(_ao_types(v)) or v}" for k, v in sorted(quant_type.items()))
    else:
        label, configs = "?", []
    fields = {
        "config": configs[0] if len(configs) == 1 else configs,
        "options": _ao_options(quant_type),
        "modules_to_not_convert": qc.get("modules_to_not_convert"),
        "include_input_output_embeddings": qc.get("include_input_output_embeddings"),
    }
    return label, fields


def _bitsandbytes(qc: dict) -> tuple[str, dict]:
    four = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit"))
    skip = qc.get("llm_int8_skip_modules")
    if four:
        quant_type = qc.get("bnb_4bit_quant_type", "fp4")
        double = bool(qc.get("bnb_4bit_use_double_quant"))
        compute = qc.get("bnb_4bit_compute_dtype")
        label = f"{quant_type}(compute_dtype={compute}{', double_quant' if double else ''})"
        fields = {
            "bits": 4,
            "quant_type": quant_type,
            "compute_dtype": compute,
            "double_quant": double,
            "skip_modules": skip,
        }
        return label, fields
    threshold = qc.get("llm_int8_threshold", 6.0)
    fp16 = bool(qc.get("llm_int8_has_fp16_weight"))
    label = f"llm-int8(threshold={threshold}{', fp16_weight' if fp16 else ''})"
    return label, {"bits": 8, "threshold": threshold, "has_fp16_weight": fp16, "skip_modules": skip}


def _w_label(qc: Mapping) -> str:
    group = qc.get("group_size")
    return f"w{qc.get('bits')}" + (f"g{group}" if group not in (None, -1) else "")


def _gptq(qc: dict) -> tuple[str, dict]:
    flags = [f for f, on in (("sym", qc.get("sym", True)), ("desc_act", qc.get("desc_act"))) if on]
    fields = {k: qc.get(k) for k in ("bits", "group_size", "sym", "desc_act", "checkpoint_format")}
    return _w_label(qc) + (f"({', '.join(flags)})" if flags else ""), fields


def _awq(qc: dict) -> tuple[str, dict]:
    kind = qc.get("version") or qc.get("format")
    flags = [str(f) for f in (("zero_point" if qc.get("zero_point") else None), kind) if f]
    fields = {k: qc.get(k) for k in ("bits", "group_size", "zero_point", "version", "format", "backend")}
    return _w_label(qc) + (f"({', '.join(flags)})" if flags else ""), fields


def _generic(qc: dict) -> tuple[str, dict]:
    fields = {k: qc[k] for k in _GENERIC_KEYS if qc.get(k) is not None}
    simple = [f"{k}={v}" for k, v in fields.items() if isinstance(v, (bool, int, float, str))]
    return (f"({', '.join(simple)})" if simple else ""), fields


# --- a loaded model ---------------------------------------------------------------------------------


def sidecar_json(folder: Path, fix: str) -> dict[str, Any] | None:
    """The JSON object of ``folder``'s quantization.json (None where there is none): the one read of the file, which
    quant/manifest.py's manifest reader types whole and :func:`sidecar` for its provenance; a one-line InputError
    naming the file and ``fix`` where it cannot be read or holds no JSON object."""
    file = Path(folder) / SIDECAR
    return read_json(file, fix=fix) if file.is_file() else None


def sidecar(folder: Path) -> Sidecar | None:
    """What the quantization.json in ``folder`` says of the model's provenance, where there is one: a field of
    another type is left out, and so is a ``source_sha256`` that is not one; a file that is no JSON object is
    refused in one line."""
    data = sidecar_json(folder, fix=f"restore the {SIDECAR} saved with the model")
    if data is None:
        return None

    def text(key: str) -> str | None:
        value = data.get(key)
        return value if isinstance(value, str) else None

    sha = text("source_sha256")
    return Sidecar(
        str(Path(folder) / SIDECAR),
        sha if sha and _SHA256.fullmatch(sha) else None,
        text("source_model"),
        text("scheme"),
        text("source_files_sha256"),
    )


def _sidecar(model: nn.Module) -> Sidecar | None:
    """:func:`sidecar` of the directory the model was loaded from, where it was loaded from one."""
    where = getattr(getattr(model, "config", None), "_name_or_path", None)
    return sidecar(Path(str(where))) if where and Path(str(where)).is_dir() else None


def imported_quantization(model: nn.Module) -> ImportedQuantization | None:
    """The record of a quantization quantgate did not make: from the model's ``quantization_config``
    (:func:`describe`, with what a sidecar says), else from the quantized tensors it holds (``origin`` the
    library, ``scheme`` naming the tensor types); None for a float model."""
    qc = quantization_config(getattr(model, "config", None))
    if qc is not None:
        return dataclasses.replace(describe(qc), sidecar=_sidecar(model))
    found = quantized_tensors(model)
    if not found:
        return None
    origin = found[0][0]
    kinds = ", ".join(dict.fromkeys(kind for _, kind in found))
    return ImportedQuantization(
        origin, f"{origin}:{kinds} (quantized tensors, no quantization_config)", {}, tensors=len(found)
    )


def quantized_tensors(model: nn.Module) -> list[tuple[str, str]]:
    """(library, kind) per quantized weight of ``model``: compressed-tensors' quantized modules, torchao
    tensor subclasses, bitsandbytes' Int8Params / Params4bit, and integer or FP8 weights."""
    found = []
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:  # compressed-tensors' Linear
            found.append(("compressed-tensors", "quantized Linear"))
            continue
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            kind = type(t)  # a Parameter of a tensor subclass keeps the subclass's type
            lib = kind.__module__.split(".")[0]
            if lib in ("torchao", "bitsandbytes"):
                found.append((lib, kind.__name__))
            elif name.endswith("weight") and t.dtype in _LOW_PRECISION:
                found.append(("tensors", f"{str(t.dtype).removeprefix('torch.')} weights"))
    return found


_LOW_PRECISION = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def check_installed(config: object, where: object) -> None:
    """Raise ModuleNotFoundError, naming the pip command, when ``config`` (a transformers config) says its
    weights were quantized by a tool whose package is not installed (transformers would raise a bare
    ImportError from inside ``from_pretrained``)."""
    qc = quantization_config(config)
    if qc is None:
        return
    method = method_of(qc)
    if method not in INSTALL:
        return
    packages, command = INSTALL[method]
    missing = [name for module, name in packages.items() if not _installed(module)]
    if missing:
        label = describe(qc).scheme
        raise MissingDependency(
            f"{where} is quantized with {label}; loading it needs {' and '.join(missing)} ({command})"
        )


def _installed(package: str) -> bool:
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that is no package, or a module whose __spec__ is None
        return False


def dequantize_(model: nn.Module) -> nn.Module:
    """Decompress, in place, a compressed-tensors or bitsandbytes model to a float one with the tool's own
    code: each quantized weight becomes its dequantized float value, the activation quantizers and the
    model's quantization_config go. Returns the model."""
    record = imported_quantization(model)
    if record is None or not record.dequantizable:
        raise InputError(
            f"cannot dequantize {record.scheme if record else 'this model'}: only compressed-tensors and "
            f"bitsandbytes models loaded with their quantization_config can be"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if record.origin == "bitsandbytes":
        dequantize = getattr(model, "dequantize", None)
        if quantizer is None or not callable(dequantize):
            raise InputError("this bitsandbytes model was not loaded by transformers: it cannot be dequantized")
        dequantize()
        return model
    from compressed_tensors.quantization import QuantizationMetadata, QuantizationStatus  # optional package

    modules = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    compressor = getattr(quantizer, "compressor", None)
    if any(getattr(m, "quantization_status", None) == QuantizationStatus.COMPRESSED for m in modules):
        if compressor is None:
            raise InputError("this compressed-tensors model was not loaded by transformers: it cannot be dequantized")
        compressor.decompress_model(model)  # the weights to float: dequantized int8 / fp8 values
    elif compressor is not None:
        compressor.remove_decompression_hook(model)
    for m in modules:  # drop the scales, the scheme and the quantized forward (activation quantization)
        QuantizationMetadata.clear_quantization(m)
        for attr in ("quantization_status", "quantization_enabled"):
            if hasattr(m, attr):
                delattr(m, attr)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model
