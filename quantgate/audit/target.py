"""The checkpoint an audit reads: a folder, a packaged model or a cached hub id, checked before anything runs (a
model folder, a family quantgate swaps, a float checkpoint or one whose float source is here, memory enough)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..files import folder_name, read_json
from ..models.families import Family, family_of
from ..models.io import DTYPES, Placement, meta_model, read_config
from ..models.record import record_of
from ..models.sources import PACKAGED, is_hub_id, resolve
from ..quant.imported import quantization_config

__all__ = ["AuditError", "Target", "target", "dtype_of", "check_memory"]


class AuditError(InputError):
    """An audit that cannot run as asked; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Target:
    """One model of the audit: its study name, where it loads from and in what."""

    name: str
    load: str  # a packaged name, a hub id or an absolute folder
    folder: Path
    config: Any  # its transformers config, read once
    family: Family
    variant: str | None  # the gated variant it was saved with, None for an ungated model
    task: str | None  # the synthetic task it was trained on (its evaluation), None for text


def target(model: str, variant: str | None) -> Target:
    """The float checkpoint ``model`` names, checked: a model folder, of a family quantgate swaps, not quantized."""
    text = str(model)
    path = Path(text)
    if path.is_dir() and not (path / "config.json").is_file() and not (path / "model" / "config.json").is_file():
        raise AuditError(
            f"{path} is not a model folder: it has no config.json; give a folder written by save_pretrained or "
            f"qg.save, a packaged model ({', '.join(PACKAGED)}) or a hub id in the local cache"
        )
    try:
        folder = _cached_hub_snapshot(text) if is_hub_id(text) else resolve(text)
        config = read_config(folder)
    except (FileNotFoundError, ValueError) as e:
        raise AuditError(str(e)) from None
    try:
        family = family_of(config)
    except ValueError as e:
        raise AuditError(f"{folder}: cannot audit it: {e}") from None
    source = _float_source(folder, config)
    if source is not None:
        return target(source, variant)
    record = record_of(config)
    saved = record.variant if record.variant and record.variant != "vanilla" else None
    packaged = PACKAGED.get(text)
    name = text if packaged else folder_name(path.resolve().name if path.is_dir() else text.split("/")[-1], "model")
    load_from = text if packaged else str(folder.resolve())  # a hub id: its snapshot in the local cache
    task = record.task or (packaged.task if packaged else None)
    return Target(name, load_from, folder, config, family, variant or saved, task)


def _cached_hub_snapshot(repo_id: str) -> Path:
    """The local cache's snapshot of hub repository ``repo_id``; an audit downloads nothing."""
    from huggingface_hub import snapshot_download

    try:
        return resolve(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), or not a repository id
        raise AuditError(
            f"{repo_id!r} is not in the local Hugging Face cache ({type(e).__name__}); an audit downloads nothing: "
            f"fetch it first (hf download {repo_id}) or give a folder"
        ) from None


def _float_source(folder: Path, config: Any) -> str | None:
    """The float checkpoint a quantized one was made from, where it names one that is here; None for a float
    checkpoint. A quantized checkpoint whose source is not here is refused, saying what to give instead."""
    record = record_of(config)
    imported = quantization_config(config)
    if not record.quantization and imported is None:
        return None
    sidecar = folder / "quantization.json"
    named = None
    if sidecar.is_file():
        try:
            named = read_json(sidecar).get("source_model")
        except ValueError:
            named = None
    own = record.quantization.scheme if record.quantization else None
    what = own or (imported or {}).get("quant_method", "quantized")
    if isinstance(named, str) and named and (named in PACKAGED or Path(named).is_dir()):
        return named
    hint = f" its quantization.json names {named!r}, which is not here;" if named else ""
    raise AuditError(
        f"{folder} is already quantized ({what}), and an audit compares a float model with its quantized "
        f"forms:{hint} give the float checkpoint it was made from (quantgate compare sets a quantized "
        f"checkpoint against its float one)"
    )


def dtype_of(target: Target, dtype: str | None) -> str:
    """``dtype`` or the checkpoint's own (config.json's ``dtype``) where quantgate evaluates in it; else float32."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise AuditError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
        return dtype
    data = read_json(target.folder / "config.json")
    stored = data.get("dtype") or data.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def _free_memory() -> int:
    """Bytes of memory a new allocation can take here: Linux's MemAvailable, else the free pages."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), flags=re.M)
        if found:
            return int(found.group(1)) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(target: Target, dtype: str, placement: Placement | None) -> None:
    """Refuse a model whose float copy and quantized copy do not fit in the memory free where the study runs it
    (the GPU where there is one, else the CPU) unless ``placement`` shards it."""
    params = sum(p.numel() for p in meta_model(target.family, target.config).parameters())
    need = int(params * DTYPES[dtype].itemsize * 2.5)  # the float model, a quantized copy, a quarter for the rest
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else _free_memory()  # where the cells run it
    if placement is None and need > free:
        raise AuditError(
            f"{target.name} has {params / 1e9:.2f} B parameters: a float and a quantized copy in {dtype} need about "
            f"{need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free here; load it sharded with "
            f"--device-map auto (and --max-memory, --offload-folder where needed)"
        )
