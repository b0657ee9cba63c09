"""Data loaders for quantgate's bundled lm-eval tasks (held-out TEST split; no download)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import datasets

from quantgate.data import corpus

DATA = Path(__file__).with_name("data")


def ppl_documents(**kwargs: object) -> datasets.DatasetDict:
    rows = [{"id": d.id, "text": d.text} for d in corpus("test")]
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
