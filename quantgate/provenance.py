"""Where and with what a result was made: the machine and the package versions, for reports."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata

import torch

from .json_record import JsonRecord

__all__ = ["git_commit", "Machine", "machine", "version", "versions"]

PACKAGES = ("quantgate", "torch", "transformers", "torchao", "bitsandbytes", "lm_eval", "accelerate")


@dataclass(frozen=True)
class Machine(JsonRecord):
    """The machine a result was made on (a study's metrics.json holds it; reports print it): its ``platform``
    (:func:`platform.platform`), logical ``cpus`` (None where the system does not say), ``python`` version, torch's
    thread count (``torch_threads``) and the first CUDA device's name (``gpu``, None without one)."""

    platform: str
    cpus: int | None
    python: str
    torch_threads: int
    gpu: str | None


def machine() -> Machine:
    """The machine this process runs on."""
    return Machine(
        platform=platform.platform(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )


def version(package: str) -> str | None:
    """The installed version of ``package``, or None where it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions(packages: tuple[str, ...] = PACKAGES) -> dict:
    return {p: version(p) for p in packages}


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """``git describe --always`` of the git checkout around ``cwd`` (default: the working directory); None outside
    one or without git, silently: git's "fatal: not a git repository" is captured, not printed. lm-eval records
    this in its results (its own version of it lets git print that line):
    :func:`quantgate.eval.evaluate.require_lm_eval` puts this one in its place."""
    try:
        run = subprocess.run(
            ["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return None
    return run.stdout.strip() or None if run.returncode == 0 else None
