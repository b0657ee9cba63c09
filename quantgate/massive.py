"""Sun et al.'s massive activations (|x| > 100 and > 1000 x the sequence's median |x|), counted per channel
with their positions and tokens: observe reports them, and ``keep=auto`` keeps the FFNs that write them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .observe_records import MassiveEntry

__all__ = ["MassiveActivations"]

Decode = Callable[[int], str | list[str]]  # a token id -> its text, for the reports (the tokenizer's)


@dataclass
class Channel:
    """The massive activations counted in one channel: how many, the largest |x|, and how often each position and
    token held one."""

    channel: int
    count: int = 0
    max_abs: float = 0.0
    positions: Counter[int] = field(default_factory=Counter)
    tokens: Counter[int] = field(default_factory=Counter)


class MassiveActivations:
    """Sun et al.'s massive activations: |x| > 100 and > 1000 x the sequence's median |x|."""

    def __init__(self, absolute: float = 100.0, relative: float = 1000.0) -> None:
        self.absolute, self.relative = absolute, relative
        self.count = 0
        self.by_channel: dict[int, Channel] = {}

    @torch.no_grad()
    def update(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> None:
        a = x.detach().float().abs().nan_to_num_(0.0)  # one full-size copy
        b, t = a.shape[:2]
        a = a.reshape(b, t, -1)
        med = a.reshape(b, -1).median(dim=1).values.view(b, 1, 1)
        hits = ((a > self.absolute) & (a > self.relative * med)).nonzero().tolist()
        self.count += len(hits)
        for i, pos, ch in hits:
            entry = self.by_channel.setdefault(ch, Channel(ch))
            entry.count += 1
            entry.max_abs = max(entry.max_abs, float(a[i, pos, ch]))
            entry.positions[pos] += 1
            if input_ids is not None and input_ids.shape[1] == t:
                entry.tokens[int(input_ids[i, pos])] += 1

    def summary(self, decode: Decode | None = None, top: int = 5) -> list[MassiveEntry]:
        rows = sorted(self.by_channel.values(), key=lambda e: -e.max_abs)[:top]
        return [
            MassiveEntry(
                channel=e.channel,
                count=e.count,
                max_abs=e.max_abs,
                positions=[[p, c] for p, c in e.positions.most_common(3)],
                tokens=[[decode(t) if decode else t, c] for t, c in e.tokens.most_common(3)],
            )
            for e in rows
        ]
