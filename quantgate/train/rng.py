"""Each process's random generators in a checkpoint (``rng-<rank>.safetensors``): torch's CPU and CUDA
states as tensors, python's and numpy's as JSON in its metadata (never pickle)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors.torch import save_file

from ..errors import InputError
from ..files import parse_json, short_repr
from ..json_record import JsonRecord
from ..models.io import read_safetensors_with_metadata


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
    """Restore this process's generators from ``file``; an InputError naming it where its states do not load (an
    edited or foreign file: unreadable, its metadata not :class:`GeneratorStates`, or a state a generator refuses)."""
    tensors, metadata = read_safetensors_with_metadata(file)
    try:
        states = GeneratorStates.from_json(metadata)
    except InputError as e:
        raise _foreign(file, f"its metadata: {e}") from None
    python, numpy = _state(file, "python", states.python, 3), _state(file, "numpy", states.numpy, 4)
    if "torch" not in tensors:
        raise _foreign(file, "it holds no 'torch' tensor")
    _restore(file, lambda: torch.set_rng_state(tensors["torch"]))
    cuda = sorted((k for k in tensors if re.fullmatch(r"cuda\.\d+", k)), key=lambda k: int(k[5:]))
    if cuda and torch.cuda.is_available():
        _restore(file, lambda: torch.cuda.set_rng_state_all([tensors[k] for k in cuda]))
    version, internal, gauss = python
    _restore(file, lambda: random.setstate((version, tuple(internal), gauss)))
    key, pos, has_gauss, np_gauss = numpy
    _restore(file, lambda: np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has_gauss, np_gauss)))


def _state(file: Path, name: str, text: str, n: int) -> list:
    """The JSON array of ``n`` items that field ``name`` of ``file``'s metadata holds (a generator's state)."""
    try:
        value = parse_json(text)
    except InputError as e:
        raise _foreign(file, f"its {name} state: {e}") from None
    if not isinstance(value, list) or len(value) != n:
        raise _foreign(file, f"its {name} state is not an array of {n} items")
    return value


def _restore(file: Path, set_state: Callable[[], object]) -> None:
    """``set_state()``: one generator given the state read from ``file``; the generator's refusal of a state it
    cannot take (torch's RuntimeError, python's and numpy's ValueError, TypeError or OverflowError) is an InputError
    naming the file."""
    try:
        set_state()
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise _foreign(file, f"{type(e).__name__}: {short_repr(str(e))}") from None


def _foreign(file: Path, why: str) -> InputError:
    return InputError(f"{file}: not the RNG states this trainer saves ({why})")
