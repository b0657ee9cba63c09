"""Data-parallel evaluation: lm-eval's requests split over the processes a launcher started.

``quantgate eval ... --processes N`` starts N copies of ``quantgate eval`` through torch's launcher
(``torch.distributed.run``: one process per GPU with CUDA, gloo on the CPU otherwise); on GPUs,
``accelerate launch --multi_gpu --num_processes N -m quantgate.cli eval ...`` does the same through accelerate's
(on a CPU, accelerate's launcher starts several processes only through MPI: use ``--processes`` or torchrun). In each
process, :func:`joined` sets up accelerate's process group, every rank loads and quantizes the same model
(the same calibration batches, so the same ranges), and :func:`share_work` makes the lm-eval model a rank of
lm-eval's own data-parallel run: lm-eval gives rank r every N-th request of each task, pads the ranks to the
same count, and gathers the logged samples and metrics on rank 0; :func:`from_first` then hands rank 0's
outcome to every rank, so every rank returns the same result and rank 0 alone writes files. Per-document
values equal a one-process run's (exactly in the tests on a CPU, batches of 8 included; where a rank's batch
groups other documents than one process does, a GPU's kernels may change the last bits of its sums). The
scores quantgate computes itself
(:func:`quantgate.eval.tasks.computed`) are not split: every rank computes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import torch

from quantgate.errors import InputError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from lm_eval.api.model import LM

__all__ = ["joined", "share_work", "from_first", "is_first", "relaunch"]

LAUNCHED = "WORLD_SIZE"  # set by torch.distributed.run and accelerate launch in every process they start


def joined() -> Accelerator | None:
    """accelerate's Accelerator of this data-parallel run (process group set up), or None in a lone process."""
    if int(os.environ.get(LAUNCHED, "1")) <= 1:
        return None
    from accelerate import Accelerator  # accelerate comes with transformers' big-model loading

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # without GPUs: accelerate's multi-CPU (gloo)
    if accelerator.num_processes <= 1:
        raise InputError(
            f"{LAUNCHED}={os.environ[LAUNCHED]} names a data-parallel run, and accelerate set up none: start it "
            "with quantgate eval --processes N, torchrun or accelerate launch"
        )
    return accelerator


def share_work(lm: LM, accelerator: Accelerator) -> None:
    """Make ``lm`` (an lm-eval model) this process's rank of lm-eval's data-parallel run."""
    lm._rank, lm._world_size = accelerator.process_index, accelerator.num_processes
    lm.accelerator = accelerator  # what lm-eval's HFLM gathers and waits through


def is_first() -> bool:
    """Whether this process writes: the only one, or rank 0 of a data-parallel run."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def from_first(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (as it is in a lone process)."""
    if not torch.distributed.is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def relaunch(argv: list[str], processes: int) -> int:
    """Run ``quantgate ARGV`` as ``processes`` data-parallel processes on this machine; their exit status."""
    gpus = torch.cuda.device_count()
    if gpus and processes > gpus:
        raise InputError(f"--processes {processes}: this machine has {gpus} GPU(s); one process per GPU")
    if not gpus and processes > (os.cpu_count() or 1):
        raise InputError(f"--processes {processes}: this machine has {os.cpu_count()} CPU core(s)")
    env = dict(os.environ)
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return subprocess.run([*launcher, "-m", "quantgate.cli", *argv], env=env).returncode
