"""Module modes: evaluation mode for a block of code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

__all__ = ["eval_mode"]


@contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """``models`` in eval mode for the block, then each back in the mode it was in, also on error."""
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, was in zip(models, modes, strict=True):
            m.train(was)
