"""Data loaders for quantgate's bundled lm-eval tasks (held-out TEST split; no download)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import datasets

from quantgate.data.corpus import corpus, in_turn, passages

DATA = Path(__file__).with_name("data")


def ppl_documents(**kwargs: object) -> datasets.DatasetDict:
    """The test split's documents, taken in turn from each work (the first document of every work, then
    the second of each, ...): a ``limit`` of n documents spans min(n, 9) works, never n chapters of one."""
    rows = [{"id": d.id, "work": d.work, "text": d.text} for d in in_turn(corpus("test"))]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def passage_documents(**kwargs: object) -> datasets.DatasetDict:
    """The test split cut into passages of at most 256 words, taken in turn from each work
    (:func:`quantgate.data.corpus.passages`): a ``limit`` of n passages gives each of the 9 works about n / 9 of
    them (all it has, where it has fewer)."""
    rows = [{"id": d.id, "work": d.work, "text": d.text} for d in passages("test")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def ppl_results(doc: dict[str, str], results: Sequence[float]) -> dict[str, tuple[float, int]]:
    (loglikelihood,) = results
    n_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, len(re.split(r"\s+", doc["text"]))),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }


def _jsonl(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def cloze_documents(**kwargs: object) -> datasets.DatasetDict:
    return _jsonl("quantgate_cloze")


def nextsent_documents(**kwargs: object) -> datasets.DatasetDict:
    return _jsonl("quantgate_nextsent")
