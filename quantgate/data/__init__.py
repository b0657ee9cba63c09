"""Data: the bundled corpus and HF datasets, bundled tokenizers, CLM/MLM batches."""

from .batches import Batches, batches
from .corpus import BUNDLED_SPLITS, Document, OfflineError, corpus
from .tokenizers import BUNDLED_TOKENIZERS, bundled_tokenizer

__all__ = [
    "Batches",
    "batches",
    "BUNDLED_SPLITS",
    "Document",
    "OfflineError",
    "corpus",
    "BUNDLED_TOKENIZERS",
    "bundled_tokenizer",
]
