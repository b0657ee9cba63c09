"""Model-ready batches from a text source: packed CLM rows or MLM rows with 80/10/10 masking.

Documents are tokenized without special tokens and joined into one stream with a separator
(EOS for CLM, [SEP] for MLM) after each document, then cut into rows of ``seq_len`` tokens:

* CLM: ``[BOS] + seq_len - 1 tokens`` when the tokenizer itself prepends BOS (the bundled BPE
  does; SmolLM2's does not), else ``seq_len`` tokens. ``labels == input_ids``: transformers'
  causal-LM heads shift them internally, so position t is scored on predicting token t + 1.
* MLM: ``[CLS] + seq_len - 2 tokens + [SEP]``; each non-special token is selected with probability
  ``mlm_probability``; a selected token becomes [MASK] (80%), a random token (10%) or stays (10%);
  ``labels`` hold the original id at selected positions and -100 elsewhere. The masks depend only
  on (seed, epoch, batch index), so a resumed run sees the same masks.

Token streams are cached in memory and on disk (``$QUANTGATE_CACHE``, default ~/.cache/quantgate).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..errors import InputError
from ..files import content_sha256
from .corpus import corpus, hf_spec
from .synthetic import BackcopyBatches, Resumable, is_backcopy, task_options

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = [
    "Batches",
    "BatchOptions",
    "Resumable",
    "batches",
    "token_stream",
    "source_sha256",
    "cache_dir",
    "prepends_bos",
    "batch_count",
    "BACKCOPY_BATCHES",
]

BACKCOPY_BATCHES = 1000  # the backcopy task's batches in one pass where max_batches does not say

log = logging.getLogger("quantgate")


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTGATE_CACHE", Path.home() / ".cache" / "quantgate"))


_STREAMS: dict[str, np.ndarray] = {}


def source_sha256(source: str) -> str | None:
    """sha256 of the local files behind text source ``source`` (an ``hf:`` source naming a folder or file of
    data files: :func:`~quantgate.files.content_sha256`, remembered in the cache so an unchanged file is read
    once); None for the bundled corpus, hub datasets (named by their id) and the synthetic tasks."""
    if not source.startswith("hf:"):
        return None
    try:
        specs, _ = hf_spec(source)
    except InputError:  # not a source: corpus() says why
        return None
    local = [Path(path) for path, _, _ in specs if Path(path).exists()]
    memo = cache_dir() / "content-sha256.json"
    return "+".join(content_sha256(p, memo=memo) for p in local) or None


def token_stream(tokenizer: PreTrainedTokenizerBase, split: str, separator: int) -> np.ndarray:
    """All documents of ``split`` tokenized and joined, ``separator`` after each, as int32. Cached by the
    tokenizer, the source's name and, for local data files, their content (:func:`source_sha256`); a cache
    file that cannot be read back is made again, with a warning."""
    content = source_sha256(split) or ""
    key = hashlib.sha256(
        f"{tokenizer.backend_tokenizer.to_str()}|{split}|{separator}{'|' + content if content else ''}".encode()
    ).hexdigest()[:24]
    if key in _STREAMS:
        return _STREAMS[key]
    path = cache_dir() / "tokens" / f"{key}.npy"
    stream = _cached_stream(path) if path.is_file() else None
    if stream is None:
        texts = [doc.text for doc in corpus(split)]
        if not texts:
            raise InputError(f"text source {split!r} has no documents")
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stream = np.fromiter((t for doc in ids for t in (*doc, separator)), dtype=np.int32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, stream)
        os.replace(tmp, path)
    _STREAMS[key] = stream
    return stream


def _cached_stream(path: Path) -> np.ndarray | None:
    """The token stream cached in ``path``; None (with a warning) where the file is corrupt or truncated."""
    try:
        stream = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        stream, why = None, f"{type(e).__name__}: {e}"
    else:
        why = f"it holds {stream.dtype} of shape {stream.shape}, not a 1-D int32 stream"
    if stream is not None and stream.dtype == np.int32 and stream.ndim == 1:
        return stream
    log.warning("token cache %s is corrupt (%s); tokenizing again", path, " ".join(why.split()))
    return None


def prepends_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def _layout(tokenizer: PreTrainedTokenizerBase, objective: str) -> tuple[list[int], list[int], int]:
    """A row's tokens before and after its text, and the separator between documents, for ``objective``."""
    if objective == "clm":
        if tokenizer.eos_token_id is None:
            raise InputError("CLM batches need a tokenizer with an EOS token to separate documents")
        return ([tokenizer.bos_token_id] if prepends_bos(tokenizer) else []), [], tokenizer.eos_token_id
    if None in (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id):
        raise InputError(
            "MLM batches need a tokenizer with [CLS], [SEP] and [MASK] tokens (a BERT "
            "tokenizer, e.g. the bundled wordpiece-8192)"
        )
    return [tokenizer.cls_token_id], [tokenizer.sep_token_id], tokenizer.sep_token_id


def batch_count(
    tokenizer: PreTrainedTokenizerBase,
    split: str,
    seq_len: int,
    batch_size: int,
    objective: str = "clm",
    max_batches: int | None = None,
) -> int:
    """The batches one pass of :func:`batches` with these settings yields (``epochs=1``): a text source's rows of
    ``seq_len`` tokens over ``batch_size`` (the last batch may be smaller), at most ``max_batches``; the backcopy
    task's ``max_batches``, else :data:`BACKCOPY_BATCHES`. What a study's dry run sets a request against."""
    if is_backcopy(split):
        return max_batches or BACKCOPY_BATCHES
    head, tail, sep = _layout(tokenizer, objective)
    body = seq_len - len(head) - len(tail)
    n = -(-(len(token_stream(tokenizer, split, sep)) // body) // batch_size) if body > 0 else 0
    return min(n, max_batches) if max_batches is not None else n


def _generator_seed(seed: int) -> int:
    """``seed`` (a run's seed folded with a batch's place) as torch's generators take it, below 2**64: unchanged
    where it fits, else reduced modulo 2**64 (a seed near the top of :data:`~quantgate.options.SEED`)."""
    return seed if seed < 2**64 else seed % 2**64


class Batches(Resumable):
    """Iterable of ``{"input_ids", "attention_mask", "labels"}`` (batch, seq_len) int64 tensors from a
    text source; resumable (see :class:`Resumable`); reshuffled each epoch when ``shuffle``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        split: str,
        seq_len: int,
        batch_size: int,
        objective: str = "clm",
        *,
        seed: int = 0,
        shuffle: bool = False,
        epochs: int | None = 1,
        mlm_probability: float = 0.15,
        max_batches: int | None = None,
    ) -> None:
        if objective not in ("clm", "mlm"):
            raise InputError(f"unknown objective {objective!r}; valid: clm, mlm")
        if seq_len < 4 or batch_size < 1:
            raise InputError(f"seq_len must be >= 4 and batch_size >= 1, got {seq_len}, {batch_size}")
        self.tokenizer, self.split, self.objective = tokenizer, split, objective
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.epochs, self.mlm_probability, self.max_batches = epochs, mlm_probability, max_batches
        head, tail, sep = _layout(tokenizer, objective)
        stream = token_stream(tokenizer, split, sep)
        body = seq_len - len(head) - len(tail)
        n_rows = len(stream) // body
        if n_rows == 0:
            raise InputError(f"text source {split!r} has {len(stream)} tokens, fewer than one row of {seq_len}")
        rows = torch.from_numpy(stream[: n_rows * body].astype(np.int64)).view(n_rows, body)
        self.rows = torch.cat(
            [torch.tensor(head).expand(n_rows, -1), rows, torch.tensor(tail).expand(n_rows, -1)], dim=1
        ).long()
        special = torch.tensor(sorted(tokenizer.all_special_ids))
        self._maskable = torch.ones(max(len(tokenizer), int(self.rows.max()) + 1), dtype=torch.bool)
        self._maskable[special] = False
        self._random_ids = self._maskable.nonzero().squeeze(1)

    def __len__(self) -> int:
        """Batches per epoch (the last one may be smaller), capped by ``max_batches``."""
        n = -(-len(self.rows) // self.batch_size)
        return min(n, self.max_batches) if self.max_batches is not None else n

    def _batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        order = self._order(epoch)
        while self.batch < len(self):
            b = self.batch
            self.batch += 1
            yield self._make(order[b * self.batch_size : (b + 1) * self.batch_size], epoch, b)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.rows))
        return torch.randperm(
            len(self.rows), generator=torch.Generator().manual_seed(_generator_seed(self.seed * 1_000_003 + epoch))
        )

    def _make(self, index: torch.Tensor, epoch: int, b: int) -> dict[str, torch.Tensor]:
        ids = self.rows[index].clone()
        mask = torch.ones_like(ids)
        if self.objective == "clm":
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
        g = torch.Generator().manual_seed(_generator_seed((self.seed * 1_000_003 + epoch) * 1_000_033 + b))
        selected = (torch.rand(ids.shape, generator=g) < self.mlm_probability) & self._maskable[ids]
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        action = torch.rand(ids.shape, generator=g)
        random_ids = self._random_ids[torch.randint(len(self._random_ids), ids.shape, generator=g)]
        ids = torch.where(selected & (action < 0.8), torch.full_like(ids, self.tokenizer.mask_token_id), ids)
        ids = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, ids)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class BatchOptions(TypedDict, total=False):
    """The keywords :func:`batches` passes on to :class:`Batches` (the backcopy task takes ``seed``,
    ``epochs`` and ``max_batches``)."""

    seed: int
    shuffle: bool
    epochs: int | None
    mlm_probability: float
    max_batches: int | None


def batches(
    tokenizer: PreTrainedTokenizerBase,
    split: str,
    seq_len: int,
    batch_size: int,
    objective: str = "clm",
    **kwargs: Unpack[BatchOptions],
) -> Batches | BackcopyBatches:
    """Batches of a text source (``train``, ``validation``, ``test`` or an HF dataset; see :class:`Batches`)
    or of the synthetic ``backcopy[:key=value,...]`` task (causal LMs; see
    :class:`~quantgate.data.synthetic.BackcopyBatches`).
    """
    if is_backcopy(split):
        if objective != "clm":
            raise InputError("the backcopy task is a causal-LM task; use --objective clm")
        max_batches = kwargs.get("max_batches")
        return BackcopyBatches(
            seq_len,
            batch_size,
            seed=kwargs.get("seed", 0),
            epochs=kwargs.get("epochs", 1),
            batches_per_epoch=max_batches or BACKCOPY_BATCHES,
            bos=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1,
            **task_options(split),
        )
    return Batches(tokenizer, split, seq_len, batch_size, objective, **kwargs)
