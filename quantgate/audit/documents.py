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
from ..eval.computed import BACKCOPY_HELD_OUT_SEED, backcopy_documents, mlm_documents
from ..eval.tasks import Task
from ..models.modes import eval_mode
from ..stats import TaskDocuments

__all__ = ["DocSet", "score_text", "MOST", "MIN_UNITS"]

SPLITS = {"search": ("test", BACKCOPY_HELD_OUT_SEED), "held-out": ("validation", BACKCOPY_HELD_OUT_SEED + 1)}
# by the unit of the task read (its row's): the most a set reads (passages, or batches of 16 sequences), and the fewest
# that give a verdict (one passage of each of 9 works)
MOST = {"documents": 270, "sequences": 8}
MIN_UNITS = {"documents": 9, "sequences": 1}
SEQUENCES = 16, 128  # a batch of a computed task: sequences, tokens each


@torch.no_grad()
def score_text(model: nn.Module, tok: PreTrainedTokenizerBase, docs: list[Document], max_length: int) -> TaskDocuments:
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
    return TaskDocuments(
        ids=[d.id for d in docs],
        loglikelihood=loglik,
        tokens=tokens,
        works=[d.work for d in docs],
        hashes=[text_hash(d.text) for d in docs],
    )


@dataclass(frozen=True)
class DocSet:
    """One of an audit's two document sets (module docstring): the evaluation ``task`` whose documents it reads (its
    row in :data:`~quantgate.eval.tasks.TASKS`: passages of text where it reads whole documents in a window, else
    sequences of its own scorer), ``role`` ("search" or "held-out"), ``n`` units (passages, or batches of 16
    sequences) and the longest window (tokens)."""

    task: Task
    role: str
    n: int
    max_length: int = 512

    @cached_property
    def texts(self) -> list[Document]:
        return passages(SPLITS[self.role][0])[: self.n] if self.task.rolling else []

    @property
    def metric(self) -> str:
        """The perplexity read from the scores: per token, for text too (the audit's scorer counts no words)."""
        return "perplexity"

    @property
    def cluster(self) -> str:
        """The unit an interval resamples: the work of a document, each sequence of the synthetic tasks."""
        return "work" if self.task.unit == "documents" else "document"

    def describe(self) -> str:
        """The set in words: ``36 passages of 9 works (the bundled test split)``."""
        if self.task.rolling:
            works = len({d.work for d in self.texts})
            return f"{len(self.texts)} passages of {works} works (the bundled {SPLITS[self.role][0]} split)"
        what = "masked-token sequences" if self.task.objective == "mlm" else "backcopy sequences"
        return f"{SEQUENCES[0] * self.n} {what} ({self.n} batch{'es' if self.n != 1 else ''} of {SEQUENCES[0]})"

    def tokens(self, tok: PreTrainedTokenizerBase) -> int:
        """Tokens one scoring reads (for the budget)."""
        if not self.task.rolling:
            return SEQUENCES[0] * SEQUENCES[1] * self.n
        return sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 for d in self.texts)

    def score(self, model: nn.Module, tok: PreTrainedTokenizerBase) -> TaskDocuments:
        """Per-document scores of ``model`` on this set (:func:`score_text`, or the synthetic tasks' scorers)."""
        if self.task.rolling:
            return score_text(model, tok, self.texts, self.max_length)
        split, seed = SPLITS[self.role]
        if self.task.objective == "mlm":
            return mlm_documents(model, tok, split=split, limit=self.n, seed=0 if self.role == "search" else 1)
        return backcopy_documents(model, tok, limit=self.n, seed=seed)
