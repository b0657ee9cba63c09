"""Every rule that keeps a study's older runs readable and their cached steps found, in one place.

The study core (:mod:`.steps`, :mod:`.records`, :mod:`.report`) knows today's formats only and asks here where an
older one differs:

- a step's key is :func:`step_key` of its parts, and a step of format 1 keeps the key it had before formats were
  numbered (:func:`versioned_key`); a step file that records no format is of format 1 (:func:`file_format`);
- the evaluation steps' keys hold :data:`EVAL_LEGACY`, the text that named their versions before formats were
  numbered (:func:`evaluation_key`);
- a float32 model's key holds no dtype, as before dtype existed (:func:`dtype_key`);
- a metrics.json written before the works and text hashes of the bundled perplexity documents were kept is read
  with them recovered (:func:`keyed`, in memory: the report reads an older file unchanged), and only
  ``quantgate report RUN --migrate`` writes them into the file (:func:`migrate`).

Frozen: cached files are found by these keys (``tests/test_step_keys.py`` pins them), and a change to what a step
computes raises its format instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..data.corpus import document_keys
from ..stats import Documents, TaskDocuments

__all__ = ["EVAL_LEGACY", "step_key", "versioned_key", "file_format", "evaluation_key", "dtype_key", "keyed", "migrate"]

# What the evaluation steps' keys hold for the versions they had before formats were numbered (per-document values;
# then quantgate_ppl 2.0; then backcopy's first prediction apart). Frozen: their cached files are found by it, and a
# change of their code raises their format.
EVAL_LEGACY = "per-document values, quantgate_ppl 2.0, backcopy after the first prediction"


def step_key(*parts: Any) -> str:
    """The key of a step's ``parts``: the first 16 hex digits of the sha256 of their JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def versioned_key(key: str, format: int) -> str:
    """A step's key at its ``format``: from 2 on the format is part of it; a key of format 1 is what it was before
    formats existed."""
    return key if format == 1 else step_key(key, "format", format)


def file_format(data: Mapping[str, Any]) -> Any:
    """The step format a cached step file records: 1 where it records none (written before formats were)."""
    return data.get("format", 1)


def evaluation_key(*settings: Any, data: Sequence[str] = ()) -> str:
    """An evaluation step's key: its ``settings``, :data:`EVAL_LEGACY`, then the sha256 of the local ``data`` files
    it reads."""
    return step_key(*settings, EVAL_LEGACY, *data)


def dtype_key(dtype: str | None) -> list[str]:
    """What a model's key holds for its ``dtype``: nothing for float32 (None), the keys it had before dtype
    existed."""
    return ["dtype", dtype] if dtype else []


def keyed(documents: Documents) -> Documents:
    """``documents`` with the work and text hash of each bundled quantgate_ppl document recorded before they were
    kept (recovered from the bundled corpus by position, where the word counts agree: :func:`document_keys`);
    other tasks' values as they are."""
    ppl = documents.get("quantgate_ppl")
    if ppl is None or (ppl.works is not None and ppl.hashes is not None) or ppl.words is None:
        return documents
    keys = document_keys(list(ppl.ids), ppl.words)
    if keys is None:
        return documents
    works, hashes = keys
    return {**documents, "quantgate_ppl": dataclasses.replace(ppl, works=works, hashes=hashes)}


def migrate(data: dict[str, Any]) -> bool:
    """Write the works and text hashes :func:`keyed` recovers into ``data``, a run's metrics.json object (one
    :func:`~.records.read_metrics` accepts; the object otherwise as it was), in place: ``quantgate report RUN
    --migrate`` (:func:`~.records.edit_metrics` reads and writes the file). True where it changed."""
    changed = False
    for cell in data.get("cells") or []:
        for holder, field_name in [(cell, "float_documents")] + [
            (r, "documents") for r in (cell.get("schemes") or {}).values()
        ]:
            written = holder.get(field_name)
            if not isinstance(written, dict):
                continue
            documents = {task: TaskDocuments.from_json(columns) for task, columns in written.items()}
            if (new := keyed(documents)) is not documents:
                holder[field_name], changed = {task: docs.to_json() for task, docs in new.items()}, True
    return changed
