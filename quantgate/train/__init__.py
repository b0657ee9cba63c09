"""Training on HF accelerate: CLM or MLM, from scratch or from a checkpoint, resumable, with outlier,
sink and gate statistics logged as training goes.

The same code runs on a CPU, one GPU, and many (``accelerate launch``; DDP, or FSDP version 2 through an
accelerate config, whose shards are gathered whole for checkpoints and the final model). Every data batch
is a *global* micro-batch; each process trains on its share, so N processes with per-device batch B see
exactly what one process with batch N x B sees.

The modules, each importing only those below it:

    loop.py         train(): the training loop, evaluation and observe passes, divergence
    resume.py       resuming from the newest complete checkpoint, every saved value checked first
    rundir.py       the run directory: its layout, another run's files refused, interrupted writes removed
    log.py          log.jsonl and the accelerate tracker (TensorBoard)
    checkpoint.py   the checkpoint format: writing one, reading trainer.json, FSDP weights gathered whole
    rng.py          each process's generator states in a checkpoint
    config.py       TrainConfig (its unset optimiser settings: the family's recipe), the settings' ranges,
                    parameter groups, the schedule
"""

from .checkpoint import TrainerRecord, can_resume
from .config import (
    FREE_ON_RESUME,
    TRAIN_RANGES,
    Batch,
    TrainConfig,
    make_data,
    param_groups,
)
from .log import scalars
from .loop import TrainingDiverged, train

__all__ = [
    "TrainConfig",
    "train",
    "can_resume",
    "TrainingDiverged",
    "make_data",
    "TRAIN_RANGES",
    "FREE_ON_RESUME",
    "TrainerRecord",
    "Batch",
    "param_groups",
    "scalars",
]
