"""Attention: the gated-SDPA function and the gate modules (importing them registers the gate kinds)."""

from .gates import build_gate
from .sdpa import BACKENDS, gated_sdpa

__all__ = ["gated_sdpa", "BACKENDS", "build_gate"]
