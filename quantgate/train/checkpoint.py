"""The checkpoint format, ``checkpoints/step-N/`` of a run directory (layout: :mod:`quantgate.train.rundir`):
writing one (:func:`write_checkpoint`), finding the newest complete one and reading its trainer.json, every
field typed and checked (:class:`TrainerRecord`); the training state it saves (:class:`Run`) and the weights gathered
whole from FSDP shards (:func:`gathered`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, cast

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ..errors import InputError, MissingFile
from ..files import publish_folder, read_json, temporary_folder, write_failure
from ..json_record import Count, JsonRecord, json_field
from ..models.families import config_of, family_of
from ..models.swap import variant_of
from ..options import AT_LEAST_1
from .config import Batch, TrainConfig
from .rng import save_rng

log = logging.getLogger("quantgate")

CHECKPOINT_FORMAT = 1  # trainer.json "format"; earlier checkpoints were accelerate's pickles and are not loaded
MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE = "model.safetensors", "optimizer.safetensors", "trainer.json"


class Checkpointable(Protocol):
    """Data a checkpointed run can resume (:func:`check_checkpointable` makes sure it has both)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class ModelIdentity(JsonRecord):
    """What a checkpoint must match to be resumed: the model's family, variant, number of parameter tensors and the
    sha of their names and shapes (16 hex digits)."""

    family: str
    variant: str
    parameters: Count
    shapes_sha: str


@dataclass(frozen=True)
class Progress(JsonRecord):
    """How far a run had come: optimizer steps taken and tokens trained on."""

    step: Count
    tokens: Count


@dataclass(frozen=True)
class OptimizerGroups(JsonRecord):
    """AdamW's param groups as torch's ``state_dict()["param_groups"]`` gives them (its moments are in
    optimizer.safetensors)."""

    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class TrainerRecord(JsonRecord):
    """trainer.json: a checkpoint's ``format`` (:data:`CHECKPOINT_FORMAT`), the model's ``identity`` and config
    (``model_config``, :func:`model_settings`), the run's ``config`` (:class:`TrainConfig` as a dict), ``world_size``
    (processes), ``progress``, and the state torch and the data stream hand back as they gave it: the optimizer's
    param groups, the LR scheduler's, the data position's and the fp16 grad scaler's (None without one)."""

    format: int
    identity: ModelIdentity
    config: dict[str, Any]
    world_size: Annotated[int, AT_LEAST_1]
    progress: Progress
    optimizer: OptimizerGroups
    scheduler: dict[str, Any]
    data: dict[str, Any]
    scaler: dict[str, Any] | None
    model_config: dict[str, Any] | None = json_field(omit_none=True)


def model_identity(model: nn.Module) -> ModelIdentity:
    """What a checkpoint must match to be resumed: family, variant, parameter names and shapes."""
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    return ModelIdentity(
        family=family_of(model).name,
        variant=str(variant_of(model)),
        parameters=len(shapes),
        shapes_sha=_sha(json.dumps(shapes, sort_keys=True)),
    )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Run:
    """The training state a checkpoint saves and a resume restores (with each process's RNG states)."""

    acc: Accelerator
    model: nn.Module  # unwrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Iterable[Batch]  # global micro-batches; resumable (Checkpointable) where the run checkpoints
    step: int = 0
    tokens: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the weights and optimizer state are split across the processes (FSDP)."""
        return self.acc.distributed_type == DistributedType.FSDP

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside accelerate's wrapper."""
        return cast(torch.optim.Optimizer, getattr(self.optimizer, "optimizer", self.optimizer))

    def parameter_names(self) -> list[str]:
        """The name of each optimizer parameter, in the optimizer's order (optimizer.safetensors' indices)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]


WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole onto the main process's CPU


def gathered(run: Run) -> dict[str, torch.Tensor] | None:
    """Under FSDP, the weights gathered whole onto the main process (every process must call this; the others
    get an empty dict); None where each process holds them whole already."""
    return _whole_weights(run) if run.sharded else None


def _whole_weights(run: Run) -> dict[str, torch.Tensor]:
    """The model's weights, whole, on the main process (empty on the others), tied weights once. Every process
    must call this: under FSDP it gathers the shards."""
    state = cast(dict[str, torch.Tensor], get_model_state_dict(run.model, options=WHOLE))  # whole: plain tensors
    first: dict[int, str] = {}  # each parameter's first name; a later one is a tied weight's alias
    tied = {n for n, p in run.model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}
    return {k: t for k, t in state.items() if k not in tied} if run.acc.is_main_process else {}


def check_checkpointable(acc: Accelerator, data: Iterable[Batch]) -> None:
    """Before any work: refuse checkpoints this trainer cannot write or resume correctly."""
    if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise InputError(
            f"checkpoints (checkpoint_every, stop_after, resume) are not supported under "
            f"{acc.distributed_type.value}: its sharded state has no pickle-free format here; use "
            f"DDP or FSDP version 2 (accelerate configs), or train without checkpoints"
        )
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise InputError(
            "checkpoints (checkpoint_every, stop_after, resume) need FSDP version 2 (fsdp_version: 2 in the "
            "accelerate config): version 1's flattened parameters do not map to the checkpoint's per-parameter "
            "optimizer state"
        )
    if not (hasattr(data, "state_dict") and hasattr(data, "load_state_dict")):
        raise InputError(
            f"checkpoints (checkpoint_every, stop_after, resume) need data that can resume: "
            f"{type(data).__name__} has no state_dict/load_state_dict; pass quantgate.data.batches "
            f"(or an object with both), or train without checkpoints"
        )


def write_checkpoint(run: Run, path: Path, identity: ModelIdentity, c: TrainConfig) -> None:
    """Write checkpoint ``path`` (layout: :mod:`quantgate.train.rundir`) into a temporary folder, then rename it.
    Under DDP the weights and optimizer state are the same on every process, under FSDP they are gathered
    whole from the shards: the main process writes them; each process writes its RNG states. A full or
    read-only disk is a one-line ValueError; the checkpoints written before stay, and the run continues from
    the newest with resume."""
    try:
        _write_files(run, path, identity, c)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(temporary_folder(path), ignore_errors=True)
        kept = sorted(p.name for p in path.parent.glob("step-*") if p.is_dir())
        raise InputError(
            f"cannot write the checkpoint {path}: {write_failure(e)}; "
            + (f"the earlier ones are kept ({', '.join(kept)}): " if kept else "")
            + "free space (or choose a writable --out) and continue with --resume"
        ) from None


def _write_files(run: Run, path: Path, identity: ModelIdentity, c: TrainConfig) -> None:
    acc = run.acc
    tmp = temporary_folder(path)
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    save_rng(tmp / f"rng-{acc.process_index}.safetensors")
    weights = _whole_weights(run)  # under FSDP every process takes part in gathering both
    moments = get_optimizer_state_dict(run.model, run.inner_optimizer, options=WHOLE)
    if acc.is_main_process:
        save_file({k: t.detach().contiguous() for k, t in weights.items()}, str(tmp / MODEL_FILE))
        index = {name: i for i, name in enumerate(run.parameter_names())}
        save_file(
            {
                f"{index[p]}.{name}": t.contiguous()
                for p, state in cast(dict[str, dict[str, torch.Tensor]], moments["state"]).items()
                for name, t in state.items()
            },
            str(tmp / OPTIMIZER_FILE),
        )
        trainer = TrainerRecord(
            format=CHECKPOINT_FORMAT,
            identity=identity,
            config=asdict(c),
            world_size=acc.num_processes,
            progress=Progress(run.step, run.tokens),
            optimizer=OptimizerGroups(run.optimizer.state_dict()["param_groups"]),
            scheduler=run.scheduler.state_dict(),
            data=cast(Checkpointable, run.data).state_dict(),  # checked by check_checkpointable
            scaler=acc.scaler.state_dict() if acc.scaler is not None else None,
            model_config=model_settings(run.model),
        )
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer.to_json(), indent=1))
    acc.wait_for_everyone()
    if acc.is_main_process:
        publish_folder(tmp, path)


UNRECORDED = frozenset(
    {"transformers_version", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "use_cache"}
)  # model config fields that do not change what the model computes (trainer.json leaves them out)


def model_settings(model: nn.Module) -> dict:
    """The model's config as trainer.json records it (as JSON reads it back), less :data:`UNRECORDED`."""
    config = config_of(model).to_dict()
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in UNRECORDED}, default=str))


def can_resume(out: str | Path) -> bool:
    """Whether run directory ``out`` holds a complete checkpoint that ``resume=True`` would continue from."""
    try:
        newest_checkpoint(Path(out))
        return True
    except FileNotFoundError:
        return False


def newest_checkpoint(out: Path | None) -> tuple[Path, TrainerRecord]:
    """The newest complete ``checkpoints/step-N`` and its trainer.json; incomplete ones are skipped with a warning."""
    found = (
        [(int(m[1]), p) for p in (out / "checkpoints").glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
        if out
        else []
    )
    skipped = []
    for _, path in sorted(found, reverse=True):
        try:
            return path, _read_trainer(path)
        except InputError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            skipped.append(f"{path.name}: {e}")
    raise MissingFile(
        f"nothing to resume: no complete checkpoint under {out}/checkpoints (train with "
        f"checkpoint_every > 0 first, or drop --resume)" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
    )


TRAINER_LIMIT = 64 << 20  # bytes: the most of a trainer.json read (a run's is a few kB)


def _read_trainer(path: Path) -> TrainerRecord:
    """trainer.json of checkpoint ``path``, every field typed and checked (:class:`TrainerRecord`); InputError saying
    why ``path`` is not a complete checkpoint, naming the file and field."""
    file = path / TRAINER_FILE
    if not file.is_file():
        raise InputError(f"it has no {TRAINER_FILE} (its write was interrupted)")
    data = read_json(file, limit=TRAINER_LIMIT)
    if data.get("format") != CHECKPOINT_FORMAT:
        raise InputError("it is in an older format (accelerate's pickled state), which quantgate does not load")
    try:
        saved = TrainerRecord.from_json(data)
    except InputError as e:  # a field missing, unknown or of another type (RecordError is one)
        raise InputError(f"{file}: {e}") from None
    missing = [f for f in (MODEL_FILE, OPTIMIZER_FILE) if not (path / f).is_file()]
    if missing:
        raise InputError(f"it lacks {', '.join(missing)}")
    world = saved.world_size
    ranks = {p.name for p in path.glob("rng-*.safetensors")}
    if world > len(ranks) or not all(f"rng-{r}.safetensors" in ranks for r in range(world)):
        raise InputError(
            f"{file}: world_size is {world}, but the checkpoint holds the RNG states of "
            f"{sum(f'rng-{r}.safetensors' in ranks for r in range(min(world, len(ranks))))} processes "
            f"(rng-<rank>.safetensors, one per process)"
        )
    return saved
