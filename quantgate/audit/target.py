"""The checkpoint an audit reads: a folder, a packaged model or a cached hub id, checked before anything runs (a
model folder, a family quantgate swaps, a float checkpoint or one whose float source is here, memory enough)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, MissingFile
from ..eval.tasks import Task, read_on
from ..files import folder_name, read_json
from ..models import cost
from ..models.families import Family, family_of
from ..models.io import DTYPES, Placement, qiu_variant, read_config
from ..models.record import record_of
from ..models.sources import PACKAGED, is_hub_id, resolve
from ..quant import source_files_sha256
from ..quant.imported import quantization_config, sidecar
from ..variants import AttentionVariant

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

    @property
    def reads(self) -> Task:
        """The evaluation task the audit reads it on: its row in :data:`~quantgate.eval.tasks.TASKS`
        (:func:`~quantgate.eval.tasks.read_on`: its synthetic task's, a masked LM's masked tokens, else text)."""
        return read_on(self.family.objective, self.task)


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
    except (InputError, MissingFile) as e:
        raise AuditError(str(e)) from None
    try:
        family = family_of(config)
    except InputError as e:
        raise AuditError(f"{folder}: cannot audit it: {e}") from None
    source = _float_source(folder, config)
    if source is not None:
        return target(source, variant)
    record = record_of(config)
    saved = record.variant if record.variant and record.variant != "vanilla" else None
    untrained = variant is not None and not AttentionVariant.parse(variant).is_vanilla  # a gate the audit would add
    if untrained and saved is None and qiu_variant(config) is None:
        raise AuditError(
            f"--variant {variant}: {folder} is ungated, and the audit would add a gate of random weights, a model no "
            f"one trained; audit it without --variant, or train the gate first (quantgate train --model {text} "
            f"--variant {variant}) and audit that"
        )
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
    """The float checkpoint a quantized one was made from, where it names one that is here and is what was
    quantized; None for a float checkpoint. A folder is taken only by its absolute path and only where its files
    hash as recorded (``source_files_sha256``): a relative path means another folder in another working directory,
    and a folder changed since is not the source. Anything else is refused, saying what to give instead."""
    record = record_of(config)
    imported = quantization_config(config)
    if not record.quantization and imported is None:
        return None
    saved = sidecar(folder)
    named, files = (saved.source_model, saved.source_files_sha256) if saved else (None, None)
    if record.quantization is not None:
        named, files = named or record.quantization.source_model, files or record.quantization.source_files_sha256
    own = record.quantization.scheme if record.quantization else None
    what = own or (imported or {}).get("quant_method", "quantized")
    fix = (
        "give the float checkpoint it was made from (quantgate compare sets a quantized checkpoint against its "
        "float one)"
    )
    start = f"{folder} is already quantized ({what}), and an audit compares a float model with its quantized forms:"
    if not isinstance(named, str) or not named:
        raise AuditError(f"{start} it names no float source; {fix}")
    if named in PACKAGED:
        return named
    if not Path(named).is_absolute():
        raise AuditError(
            f"{start} it names its float source {named!r}, a path relative to wherever it was quantized, which may "
            f"be another folder here; {fix}"
        )
    if not Path(named).is_dir():
        raise AuditError(f"{start} its float source {named} is not here; {fix}")
    if not isinstance(files, str) or source_files_sha256(named) != files:
        why = "its files differ from the ones" if isinstance(files, str) else "no hash of its files was"
        raise AuditError(f"{start} {named} is not checked as its float source ({why} recorded then); {fix}")
    return named


def dtype_of(target: Target, dtype: str | None) -> str:
    """``dtype`` or the checkpoint's own (config.json's ``dtype``) where quantgate evaluates in it; else float32."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise AuditError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
        return dtype
    data = read_json(target.folder / "config.json")
    stored = data.get("dtype") or data.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def check_memory(target: Target, dtype: str, placement: Placement | None) -> None:
    """Refuse a model whose float copy and quantized copy do not fit in the memory free where the audit runs it
    (the GPU where there is one, else the CPU) unless ``placement`` shards it: the check a study's dry run makes
    (:func:`quantgate.models.cost.check_memory`)."""
    if placement is None:
        fix = "load it sharded with --device-map auto (and --max-memory, --offload-folder where needed)"
        cost.check_memory(target.name, target.family, target.config, dtype, fix, error=AuditError)
