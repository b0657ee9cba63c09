"""The documents an audit scores a model on, and the scorer: per document, the summed log-likelihood (nats,
accumulated in float64 from float32 log-probabilities, whatever the model's dtype) and the tokens predicted.

Two sets, never mixed: the *search* set, which every candidate recipe is tried on, and the *held-out* set, which
only the final certification reads (:mod:`quantgate.certify`). For text they are other works: the search reads
passages of the bundled test split, the certificate passages of the validation split (nine other works; the
Devil's Dictionary's other entries), both cut to at most :data:`~quantgate.data.corpus.PASSAGE_WORDS` words and
taken in turn from each work, so that every work weighs about the same (:func:`~quantgate.data.corpus.passages`).
A model trained on the backcopy task reads held-out sequences of its task (another seed for the certificate); a
masked LM, masked-token batches of the test and validation splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from ..data.corpus import Document, passages, text_hash
from ..evaluate import BACKCOPY_HELD_OUT_SEED, backcopy_documents, mlm_documents
from ..models.modes import eval_mode
from ..stats import CLUSTER_COLUMN, HASH_COLUMN

__all__ = ["DocSet", "score_text", "KINDS"]

KINDS = ("text", "backcopy", "mlm")  # what a model reads: passages, backcopy sequences, masked-token batches
SPLITS = {"search": ("test", BACKCOPY_HELD_OUT_SEED), "held-out": ("validation", BACKCOPY_HELD_OUT_SEED + 1)}
MOST = {"text": 270, "backcopy": 8, "mlm": 8}  # the most units a set reads: passages, or batches of 16 sequences


@torch.no_grad()
def score_text(model: nn.Module, tok: PreTrainedTokenizerBase, docs: list[Document], max_length: int) -> dict:
    """Per document: its summed log-likelihood (nats, float64) and the tokens predicted, read as lm-eval's rolling
    windows read it: disjoint windows of ``max_length`` tokens, the first after the prefix token (BOS, else EOS),
    each later one after the last token of the one before (a passage of the audit's sets is one window); its work
    and text hash, for paired intervals."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    device = next(model.parameters()).device
    loglik, tokens = [], []
    with eval_mode(model):
        for d in docs:
            ids = [prefix, *tok(d.text, add_special_tokens=False)["input_ids"]]
            total = 0.0
            for start in range(0, len(ids) - 1, max_length - 1):
                x = torch.tensor([ids[start : start + max_length]], device=device)
                logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
                total += float(logp.gather(-1, x[0, 1:, None])[:, 0].double().sum())
            loglik.append(total)
            tokens.append(len(ids) - 1)
    return {
        "ids": [d.id for d in docs],
        "loglikelihood": loglik,
        "tokens": tokens,
        CLUSTER_COLUMN: [d.work for d in docs],
        HASH_COLUMN: [text_hash(d.text) for d in docs],
    }


@dataclass(frozen=True)
class DocSet:
    """One of an audit's two document sets (module docstring): ``kind`` (:data:`KINDS`), ``role`` ("search" or
    "held-out"), ``n`` units (passages, or batches of 16 sequences) and the longest window (tokens)."""

    kind: str
    role: str
    n: int
    max_length: int = 512

    @cached_property
    def texts(self) -> list[Document]:
        return passages(SPLITS[self.role][0])[: self.n] if self.kind == "text" else []

    @property
    def metric(self) -> str:
        """The perplexity read from the scores (per token)."""
        return "perplexity"

    @property
    def cluster(self) -> str:
        """The unit an interval resamples: the work of a passage, each sequence of the synthetic tasks."""
        return "work" if self.kind == "text" else "document"

    def describe(self) -> str:
        """The set in words: ``36 passages of 9 works (the bundled test split)``."""
        if self.kind == "text":
            works = len({d.work for d in self.texts})
            return f"{len(self.texts)} passages of {works} works (the bundled {SPLITS[self.role][0]} split)"
        what = "backcopy sequences" if self.kind == "backcopy" else "masked-token sequences"
        return f"{16 * self.n} {what} ({self.n} batch{'es' if self.n != 1 else ''} of 16)"

    def tokens(self, tok: PreTrainedTokenizerBase) -> int:
        """Tokens one scoring reads (for the budget)."""
        if self.kind != "text":
            return 16 * 128 * self.n
        return sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 for d in self.texts)

    def score(self, model: nn.Module, tok: PreTrainedTokenizerBase) -> dict:
        """Per-document scores of ``model`` on this set (:func:`score_text`, or the synthetic tasks' scorers)."""
        if self.kind == "text":
            return score_text(model, tok, self.texts, self.max_length)
        if self.kind == "backcopy":
            return backcopy_documents(model, tok, limit=self.n, seed=SPLITS[self.role][1])
        split = SPLITS[self.role][0]
        return mlm_documents(model, tok, split=split, limit=self.n, seed=0 if self.role == "search" else 1)
