"""Which Linears of a model a scheme quantizes: every backend's and every format's answer to the same question."""

from __future__ import annotations

import fnmatch
from typing import cast

import torch.nn as nn
from transformers import PreTrainedModel

from ..models.families import family_of
from ..models.swap import attention_modules
from .schemes import Scheme

__all__ = ["kept_modules", "quantizable_linears", "kept_linears"]


def kept_modules(model: nn.Module, scheme: Scheme) -> set[str]:
    """Names of the modules left in full precision, with everything inside them: the LM head (under
    ``acts=bondarenko`` the family's whole task head), the attention gates unless ``scheme.gates``,
    and the scheme's ``keep`` patterns."""
    names = {id(m): n for n, m in model.named_modules()}
    head = cast(PreTrainedModel, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    roots = {names[id(head)]} if head is not None and id(head) in names else set()
    family = family_of(model)
    if scheme.task_head_in_float and family.head is not None:
        roots.add(family.head)
    if not scheme.gates:
        roots |= {names[id(attn.gate)] for attn in attention_modules(model) if hasattr(attn, "gate")}
    roots |= {n for n in names.values() if any(fnmatch.fnmatch(n, p) for p in scheme.keep)}
    return {n for n in names.values() if n in roots or any(n.startswith(r + ".") for r in roots if r)}


def quantizable_linears(model: nn.Module, scheme: Scheme) -> list[tuple[str, nn.Linear]]:
    kept = kept_modules(model, scheme)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in kept]


def kept_linears(model: nn.Module, scheme: Scheme) -> list[str]:
    """The Linears ``scheme`` leaves in full precision, sorted (transformers' quantization configs name them)."""
    kept = kept_modules(model, scheme)
    return sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in kept)
