"""Where and with what a result was made: the machine and the package versions, for reports."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import torch

__all__ = ["git_commit", "machine", "version", "versions"]

PACKAGES = ("quantgate", "torch", "transformers", "torchao", "bitsandbytes", "lm_eval", "accelerate")


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


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
