"""Where and with what a result was made: the machine and the package versions, for reports."""

from __future__ import annotations

import os
import platform
from importlib import metadata

import torch

__all__ = ["machine", "version", "versions"]

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
