"""Each process's random generators in a checkpoint (``rng-<rank>.safetensors``): torch's CPU and CUDA
states as tensors, python's and numpy's as JSON in its metadata (never pickle)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import InputError
from ..files import short_repr
from ..json_record import JsonRecord


@dataclass(frozen=True)
class GeneratorStates(JsonRecord):
    """The metadata of ``rng-<rank>.safetensors`` (safetensors metadata holds text): python's
    ``random.getstate()`` (``python``: JSON of its version, internal state and gauss) and numpy's legacy global
    generator (``numpy``: JSON of its MT19937 key, pos, has_gauss and gauss)."""

    python: str
    numpy: str


def save_rng(file: Path) -> None:
    """Write this process's generator states to ``file`` (safetensors; python's and numpy's in its metadata)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    # the legacy global generator's state is always the (MT19937, key, pos, has_gauss, gauss) tuple
    _, key, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    save_file(
        tensors,
        str(file),
        metadata=GeneratorStates(
            python=json.dumps(random.getstate()), numpy=json.dumps([key.tolist(), pos, has_gauss, gauss])
        ).to_json(),
    )


def load_rng(file: Path) -> None:
    """Restore this process's generators from ``file``; ValueError naming it where its states do not load."""
    try:
        _set_rng(file)
    except (KeyError, ValueError, TypeError, RuntimeError, OverflowError) as e:  # an edited or foreign file
        raise InputError(
            f"{file}: not the RNG states this trainer saves ({type(e).__name__}: {short_repr(str(e))})"
        ) from None


def _set_rng(file: Path) -> None:
    with safe_open(str(file), framework="pt") as fh:
        states = GeneratorStates.from_json(fh.metadata())
        torch.set_rng_state(fh.get_tensor("torch"))
        cuda = sorted((k for k in fh.keys() if k.startswith("cuda.")), key=lambda k: int(k[5:]))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([fh.get_tensor(k) for k in cuda])
    version, internal, gauss = json.loads(states.python)
    random.setstate((version, tuple(internal), gauss))
    key, pos, has_gauss, gauss = json.loads(states.numpy)
    np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has_gauss, gauss))
