"""Attention: the gated-SDPA function and the gate modules."""

from .sdpa import BACKENDS, gated_sdpa

__all__ = ["gated_sdpa", "BACKENDS"]
