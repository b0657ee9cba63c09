"""The C heap's free pages given back to the system while a model is quantized (glibc's ``malloc_trim``).

glibc's malloc serves tensors below its mmap threshold (adaptive, up to 32 MiB: activations, the float32
temporaries of a weight's blocks) from its heap, and gives free heap memory back only from the top of the
heap. Quantizing allocates small tensors that stay (range statistics, scales) between large ones that do not:
each pins the heap above the free space below it, which later allocations, a little larger or a little
differently placed, do not reuse. One calibration forward of an fp32 SmolLM2 at 512 tokens grew the heap by
about 200 MiB (0.4x the model), all of it free, and torchao's Linears, quantized one after another, by the
float weights' bytes. :func:`trim` (``malloc_trim(0)``: madvise(MADV_DONTNEED) on the free pages anywhere in
the heap; 0.2-2 ms a call) after each block of work keeps the free pages from staying resident.
:func:`trimming` does it after each transformer block of a forward. Without glibc (macOS, musl) both do
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import torch.nn as nn

from ..errors import InputError
from ..models.families import family_of

__all__ = ["trim", "trimming"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def trim() -> None:
    """Give the heap's free pages back to the system (module docstring)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _trim_hook(module: nn.Module, args: tuple, output: object) -> None:
    trim()


@contextlib.contextmanager
def trimming(model: nn.Module) -> Iterator[None]:
    """While inside, :func:`trim` after each block (decoder layer) of ``model``'s forward passes: its family's
    blocks (:mod:`quantgate.models.families`), none for a model of no family quantgate knows."""
    try:
        blocks = family_of(model).blocks(model) if _MALLOC_TRIM is not None else []
    except (InputError, AttributeError):  # no family, or no blocks where the family has them
        blocks = []
    handles = [block.register_forward_hook(_trim_hook) for block in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        trim()
