"""Synthetic sink-inducing data: the bigram-backcopy task (Guo et al. 2024, "active-dormant heads").

Tokens follow a fixed random bigram chain (each token has ``branching`` possible successors), which
an MLP learns; a few trigger tokens break the chain: the token after a trigger repeats the token
before it, which needs attention. Attention heads have nothing to do except right after a trigger,
so an ungated softmax must park their mass somewhere: the first token becomes a sink, quickly and
on a CPU budget.

A data source names the task: ``backcopy`` or ``backcopy:key=value,...`` with the options of
:data:`TASK_OPTIONS`. ``start=chain`` draws the token after BOS from BOS's successors like every other
chain step; the default (``start=random``) draws it uniformly from the whole vocabulary, so the
prediction at BOS must come out flat, and the twins search found gated models writing a huge last-layer
activation at BOS to flatten it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import torch

from ..errors import InputError
from ..json_record import Count, JsonRecord
from ..options import Option, Range, key_values

__all__ = [
    "BackcopyBatches",
    "Resumable",
    "DataPosition",
    "TASK_OPTIONS",
    "TaskOptions",
    "is_backcopy",
    "task_options",
]

_STARTS = ("random", "chain")  # the token after BOS: uniform over the vocabulary, or drawn from BOS's successors

# start: see _STARTS; trigger_prob: the chance of a trigger at each position; triggers: how many there are
TASK_OPTIONS: dict[str, Option] = {
    "start": Option(str, _STARTS),
    "trigger_prob": Option(float, Range.between(0, 1)),
    "triggers": Option(int, Range.between(1)),
}


class TaskOptions(TypedDict, total=False):
    """The :class:`BackcopyBatches` keywords a data source can set (:data:`TASK_OPTIONS`)."""

    start: str
    trigger_prob: float
    triggers: int


def is_backcopy(source: str) -> bool:
    """Whether a data source names the synthetic backcopy task (``backcopy`` or ``backcopy:...``)."""
    return source.partition(":")[0] == "backcopy"


@dataclass(frozen=True)
class DataPosition(JsonRecord):
    """Where a :class:`Resumable` stream stands (its ``state_dict()``, which trainer.json keeps as ``data``): the
    ``epoch`` and the next ``batch`` in it, of the stream's ``split`` and ``seed``."""

    epoch: Count
    batch: Count
    split: str
    seed: int


class Resumable:
    """Epoch/batch bookkeeping shared by the batch iterables (:class:`~quantgate.data.batches.Batches`
    and :class:`BackcopyBatches`).

    ``epochs=None`` repeats forever. Every ``for`` loop starts from the beginning, except the first
    one after ``load_state_dict``, which continues where the saved state stopped; ``state_dict()``
    after a batch names the next one. Subclasses set ``split``, ``seed``, ``epochs`` and define
    ``_batches(epoch)``, which yields from ``self.batch`` on and advances it.
    """

    epoch = batch = 0
    _resume: tuple[int, int] | None = None
    split: str
    seed: int
    epochs: int | None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.epoch, self.batch = self._resume or (0, 0)
        self._resume = None
        while self.epochs is None or self.epoch < self.epochs:
            yield from self._batches(self.epoch)
            self.epoch, self.batch = self.epoch + 1, 0

    def _batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} must define _batches(epoch)")

    def state_dict(self) -> dict[str, Any]:
        """The stream's :class:`DataPosition`, as JSON."""
        return DataPosition(self.epoch, self.batch, self.split, self.seed).to_json()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue, at the next ``for`` loop, from the :class:`DataPosition` ``state`` (JSON) of this split, seed."""
        position = DataPosition.from_json(state)
        if (position.split, position.seed) != (self.split, self.seed):
            raise InputError(
                f"data state is for split {position.split!r} seed {position.seed}, not {self.split!r} seed {self.seed}"
            )
        self._resume = (position.epoch, position.batch)


def task_options(source: str) -> TaskOptions:
    """The :class:`BackcopyBatches` keywords of a ``backcopy[:key=value,...]`` source; ValueError naming
    an unknown option or a value outside its range."""
    _, _, arg = source.partition(":")
    if not is_backcopy(source):
        raise InputError(f"{source!r} is not a backcopy source (backcopy[:key=value,...])")
    valid = ", ".join(f"{k} ({o.type.__name__}, {o.wants})" for k, o in TASK_OPTIONS.items())
    parsed = dict(
        key_values("backcopy", arg, lambda k: TASK_OPTIONS[k].type if k in TASK_OPTIONS else None, valid=valid)
    )
    for key, value in parsed.items():
        TASK_OPTIONS[key].check("backcopy", key, value)
    return cast(TaskOptions, parsed)  # key_values converted each value to its TASK_OPTIONS type


class BackcopyBatches(Resumable):
    """Iterable of CLM batches ``{"input_ids", "attention_mask", "labels"}`` (batch, seq_len).

    Vocabulary: ``n_tokens`` ids starting at ``first_id`` (above the special tokens), ``triggers`` of
    them are triggers (emitted with probability ``trigger_prob`` at each step); every row starts with
    ``bos``, followed by a uniform draw (``start="random"``) or one of BOS's successors (``"chain"``).
    The task (chain and triggers) is fixed by ``task_seed``; the sequences drawn from it by (``seed``,
    batch index), so held-out data is another ``seed`` of the same task. Resumable like :class:`Batches`.
    """

    def __init__(
        self,
        seq_len: int,
        batch_size: int,
        *,
        n_tokens: int = 512,
        triggers: int = 3,
        branching: int = 3,
        trigger_prob: float = 0.08,
        start: str = "random",
        first_id: int = 5,
        bos: int = 1,
        seed: int = 0,
        task_seed: int = 0,
        epochs: int | None = None,
        batches_per_epoch: int = 1000,
    ) -> None:
        if start not in _STARTS:
            raise InputError(f"backcopy: start={start!r} is not one of {', '.join(_STARTS)}")
        self.seq_len, self.batch_size, self.seed, self.bos = seq_len, batch_size, seed, bos
        self.first_id, self.n_tokens, self.trigger_prob = first_id, n_tokens, trigger_prob
        self.epochs, self.batches_per_epoch, self.start = epochs, batches_per_epoch, start
        self.split = f"backcopy(seed={seed}{'' if start == 'random' else ', start=' + start})"
        g = torch.Generator().manual_seed(10_000 + task_seed)
        self.triggers = torch.randperm(n_tokens, generator=g)[:triggers] + first_id
        self.successors = torch.randint(first_id, first_id + n_tokens, (first_id + n_tokens, branching), generator=g)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        while self.batch < self.batches_per_epoch:
            b = self.batch
            self.batch += 1
            yield self.make(epoch * self.batches_per_epoch + b)

    def make(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        b, t = self.batch_size, self.seq_len
        ids = torch.empty(b, t, dtype=torch.long)
        ids[:, 0] = self.bos
        ids[:, 1] = torch.randint(self.first_id, self.first_id + self.n_tokens, (b,), generator=g)
        branch = torch.randint(self.successors.shape[1], (b, t), generator=g)
        if self.start == "chain":  # after the same draws as "random": both tasks share every other random stream
            ids[:, 1] = self.successors[self.bos, branch[:, 1]]
        fire = torch.rand(b, t, generator=g) < self.trigger_prob
        which = self.triggers[torch.randint(len(self.triggers), (b, t), generator=g)]
        for i in range(2, t):
            prev = ids[:, i - 1]
            chain = self.successors[prev, branch[:, i]]
            after_trigger = torch.isin(prev, self.triggers)
            nxt = torch.where(fire[:, i], which[:, i], chain)
            ids[:, i] = torch.where(after_trigger, ids[:, i - 2], nxt)  # copy the token before the trigger
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def copy_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) True where the token is a copy (the previous token is a trigger): the attention's job."""
        after = torch.zeros_like(ids, dtype=torch.bool)
        after[:, 2:] = torch.isin(ids[:, 1:-1], self.triggers)
        return after
