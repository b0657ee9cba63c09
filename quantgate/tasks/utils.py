"""Data loaders for quantgate's bundled lm-eval tasks (held-out TEST split; no download)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets

DATA = Path(__file__).with_name("data")


def ppl_documents(**kwargs) -> datasets.DatasetDict:
    from quantgate.data import corpus

    rows = [{"id": d.id, "text": d.text} for d in corpus("test")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def ppl_results(doc, results):
    (loglikelihood,) = results
    n_bytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, len(re.split(r"\s+", doc["text"]))),
            "byte_perplexity": (loglikelihood, n_bytes), "bits_per_byte": (loglikelihood, n_bytes)}


def _jsonl(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def cloze_documents(**kwargs) -> datasets.DatasetDict:
    return _jsonl("quantgate_cloze")


def nextsent_documents(**kwargs) -> datasets.DatasetDict:
    return _jsonl("quantgate_nextsent")
