"""The tasks quantgate scores itself, without lm-eval (a :class:`~quantgate.eval.tasks.Task` row's ``compute``): each
takes the model, its tokenizer and lm-eval's ``limit`` and gives its per-document columns (:mod:`quantgate.stats`
reads them), from which the row's ``results`` aggregates the task's metrics."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from ..data import batches
from ..data.corpus import text_hash
from ..data.synthetic import BackcopyBatches
from ..models.modes import eval_mode
from ..models.record import record_of
from ..stats import TaskDocuments, aggregate

__all__ = [
    "BACKCOPY_HELD_OUT_SEED",
    "mlm_documents",
    "mlm_results",
    "mlm_perplexity",
    "backcopy_documents",
    "backcopy_results",
    "backcopy_metrics",
    "scored",
]

BACKCOPY_HELD_OUT_SEED = 1_000_003


def scored(docs: TaskDocuments) -> list[tuple[Any, list[float]]]:
    """(document id, [its log-likelihood]) of a computed task's documents."""
    assert docs.loglikelihood is not None  # every task quantgate scores itself records it
    return [(i, [ll]) for i, ll in zip(docs.ids, docs.loglikelihood, strict=True)]


def mlm_results(docs: TaskDocuments) -> dict:
    """The masked-token task's metric from its documents: perplexity."""
    return {"perplexity": aggregate(docs, "perplexity")}


def backcopy_results(docs: TaskDocuments) -> dict:
    """The backcopy task's metrics from its documents."""
    return {m: aggregate(docs, m) for m in ("perplexity", "perplexity_after_first", "copy_acc")}


def _token_hashes(ids: torch.Tensor) -> list[str]:
    """The hash of each row's token ids (B, T): which sequence a computed task's row is."""
    return [text_hash(row.astype("<i8").tobytes()) for row in ids.cpu().numpy()]


def mlm_perplexity(model: nn.Module, tokenizer: PreTrainedTokenizerBase, **options: Any) -> float:
    """Masked-token perplexity: exp(mean cross-entropy over the 15% masked positions), fixed masks;
    ``options``: those of :func:`mlm_documents`."""
    return aggregate(mlm_documents(model, tokenizer, **options), "perplexity")


@torch.no_grad()
def mlm_documents(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    split: str = "test",
    seq_len: int = 128,
    batch_size: int = 16,
    seed: int = 0,
    limit: int | float | None = None,
) -> TaskDocuments:
    """Per sequence: the log-likelihood summed over its masked positions, and how many there are."""
    data = batches(tokenizer, split, seq_len, batch_size, "mlm", seed=seed)
    n = len(data) if limit is None else max(1, int(limit if limit >= 1 else limit * len(data)))
    loglik, tokens, hashes = [], [], []
    device = next(model.parameters()).device
    with eval_mode(model):
        for i, batch in enumerate(data):
            if i >= n:
                break
            hashes += _token_hashes(batch["input_ids"])
            logits = model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits.float()
            labels = batch["labels"].to(device)
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            loglik += (-nll.sum(1)).tolist()
            tokens += (labels != -100).sum(1).tolist()
    return TaskDocuments(ids=list(range(len(loglik))), loglikelihood=loglik, tokens=tokens, hashes=hashes)


def backcopy_metrics(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int = 128,
    batch_size: int = 16,
    limit: int | float | None = None,
) -> dict:
    """Held-out backcopy sequences (``limit`` batches, default 8): perplexity over all predicted tokens,
    and accuracy (greedy) on the copied tokens."""
    return backcopy_results(backcopy_documents(model, tokenizer, seq_len=seq_len, batch_size=batch_size, limit=limit))


@torch.no_grad()
def backcopy_documents(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int = 128,
    batch_size: int = 16,
    limit: int | float | None = None,
    seed: int = BACKCOPY_HELD_OUT_SEED,
) -> TaskDocuments:
    """Per held-out sequence (drawn with ``seed``): summed log-likelihood and count of its predicted tokens, the same
    without the first prediction (the token after BOS: on backcopy a uniformly random one, whose prediction must
    come out flat), greedy hits on and count of its copied tokens."""
    task = record_of(model).task or "backcopy"  # recorded by train
    data = batches(
        tokenizer,
        task,
        seq_len,
        batch_size,
        seed=seed,
        max_batches=int(limit) if limit and limit >= 1 else 8,
    )
    assert isinstance(data, BackcopyBatches)  # train records only backcopy tasks, and backcopy is the default
    device = next(model.parameters()).device
    loglik: list[float] = []
    tokens: list[int] = []
    loglik_after: list[float] = []
    tokens_after: list[int] = []
    copied: list[int] = []
    copies: list[int] = []
    hashes: list[str] = []
    with eval_mode(model):
        for batch in data:
            ids = batch["input_ids"].to(device)
            hashes += _token_hashes(ids)
            logits = model(input_ids=ids).logits.float()[:, :-1]
            target = ids[:, 1:]
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            copy = data.copy_positions(ids)[:, 1:]
            loglik += (-nll.sum(1)).tolist()
            tokens += [target.shape[1]] * len(target)
            loglik_after += (-nll[:, 1:].sum(1)).tolist()
            tokens_after += [target.shape[1] - 1] * len(target)
            copied += ((logits.argmax(-1) == target) & copy).sum(1).tolist()
            copies += copy.sum(1).tolist()
    return TaskDocuments(
        ids=list(range(len(tokens))),
        loglikelihood=loglik,
        tokens=tokens,
        loglikelihood_after_first=loglik_after,
        tokens_after_first=tokens_after,
        copied=copied,
        copies=copies,
        hashes=hashes,
    )
