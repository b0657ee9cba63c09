"""Helpers for the experiment scripts (experiments/*.py): evaluation sequences, perplexity under a
custom attention mask, the change of perplexity between two settings with its paired interval over
sequences, first-token attention per layer and query position, and the report header.

Shapes: ids (B, L) int64; masks (B | 1, 1, L, L) bool, True = attend.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn
from matplotlib.figure import Figure
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .data import batches
from .data.batches import prepends_bos
from .data.corpus import corpus, in_turn
from .errors import InputError, MissingFile
from .model_files import load
from .models.families import config_of
from .models.swap import VariantAttention, attention_modules, variant_of
from .plots import save_png
from .provenance import machine, versions
from .stats import Delta, format_ratio, paired_delta  # format_ratio: for the scripts
from .study import read_metrics

__all__ = [
    "sequences",
    "document_starts",
    "nll",
    "perplexity",
    "ppl_change",
    "format_ratio",
    "window_mask",
    "first_token_attention",
    "trained_models",
    "with_rope",
    "header",
    "write",
    "script_args",
    "save_figure",
]


def sequences(tokenizer: PreTrainedTokenizerBase, source: str, seq_len: int, n: int, *, seed: int = 0) -> torch.Tensor:
    """(n, seq_len) held-out token ids from a text source or ``backcopy``."""
    rows = []
    for batch in batches(tokenizer, source, seq_len, 1, "clm", seed=seed, max_batches=n):
        rows.append(batch["input_ids"])
        if len(rows) == n:
            break
    return torch.cat(rows)


def document_starts(
    tokenizer: PreTrainedTokenizerBase, n: int, length: int, source: str = "test"
) -> tuple[torch.Tensor, list[str]]:
    """(n, length) token ids, one row per document: the first ``length`` tokens (BOS first where the tokenizer
    prepends one) of each of the first ``n`` documents of ``source`` that hold that many, taken in turn from
    each work (quantgate_ppl's order); and each row's work. The rows are independent units for a paired
    interval, as consecutive windows of one packed stream (:func:`sequences`) are not."""
    head = [tokenizer.bos_token_id] if prepends_bos(tokenizer) else []
    rows, works = [], []
    for doc in in_turn(corpus(source)):
        ids = head + tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
            works.append(doc.work)
            if len(rows) == n:
                return torch.tensor(rows), works
    raise InputError(f"{source} holds {len(rows)} documents of at least {length} tokens, fewer than the {n} asked")


@torch.no_grad()
def nll(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, *, start: int = 1) -> torch.Tensor:
    """Per-sequence summed negative log-likelihood (nats) of tokens ``start`` .. L-1, shape (B,), and
    with ``mask`` (B|1, 1, L, L) bool as the attention mask of every layer."""
    model.eval()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, start - 1 : -1]
    target = ids[:, start:]
    return nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none").sum(-1)


def perplexity(total_nll: torch.Tensor, tokens: int) -> float:
    return math.exp(float(total_nll.sum()) / tokens)


def ppl_change(
    base_nll: torch.Tensor | Sequence[float], new_nll: torch.Tensor | Sequence[float], tokens_per_sequence: int
) -> Delta:
    """The relative change of perplexity ppl_new / ppl_base - 1 between two settings evaluated on the same
    sequences, with a 95% paired interval over the sequences (:func:`quantgate.stats.paired_delta`).

    ``base_nll``, ``new_nll``: per-sequence summed NLL in nats (as :func:`nll` returns), shape (B,), tensors or
    lists, sequence i the same in both; ``tokens_per_sequence``: tokens each sum covers (L - start)."""

    def documents(values: torch.Tensor | Sequence[float]) -> dict:
        v = torch.as_tensor(values, dtype=torch.float64).tolist()
        return {"ids": list(range(len(v))), "loglikelihood": [-x for x in v], "tokens": [tokens_per_sequence] * len(v)}

    return paired_delta(documents(base_nll), documents(new_nll), "perplexity")


def window_mask(length: int, window: int, sinks: int = 0) -> torch.Tensor:
    """(1, 1, L, L) causal sliding-window mask: query i sees keys i-window+1 .. i, plus keys 0 .. sinks-1
    (a rolling KV cache of ``window`` recent tokens, with or without the first ``sinks``)."""
    i = torch.arange(length).view(-1, 1)
    j = torch.arange(length).view(1, -1)
    allowed = (j <= i) & ((i - j < window) | (j < sinks))
    return allowed.view(1, 1, length, length)


class _FirstTokenProbe:
    """Collects gated_sdpa's first-key attention mass (B, H, N) per attention layer."""

    sink_tokens = 1

    def __init__(self, modules: list[nn.Module]) -> None:
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.mass: list[torch.Tensor | None] = [None] * len(modules)

    def record_sink_mass(self, module: nn.Module, mass: torch.Tensor) -> None:
        self.mass[self.index[id(module)]] = mass.float().mean(1).cpu()  # mean over heads: (B, N)


@contextmanager
def _probe(model: nn.Module) -> Iterator[_FirstTokenProbe]:
    modules = attention_modules(model)
    probe = _FirstTokenProbe(modules)
    for m in modules:
        cast(VariantAttention, m).qg_observer = probe
    try:
        yield probe
    finally:
        for m in modules:
            cast(VariantAttention, m).qg_observer = None


@torch.no_grad()
def first_token_attention(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(layers, B, L) attention probability on the first token, averaged over heads, per query
    position (O(L) memory: from the log-sum-exp, never the L x L matrix). Needs a quantgate model."""
    model.eval()
    with _probe(model) as probe:
        model(input_ids=ids, attention_mask=mask)
    return torch.stack(cast(list[torch.Tensor], probe.mass))  # a quantgate model: every layer recorded its mass


def trained_models(run_dir: str | Path, seed: int = 0) -> dict[str, nn.Module]:
    """{variant: model} of the trained cells of a study run at ``seed`` (read from its metrics.json)."""
    run_dir = Path(run_dir)
    rerun = f"quantgate study experiments/{run_dir.name}.yaml"
    cells = [c for c in read_metrics(run_dir).cells if c.is_trained and c.seed == seed] if run_dir.is_dir() else []
    if not cells:
        raise MissingFile(f"{run_dir} holds no trained cells for seed {seed}; run its study first: {rerun}")
    out = {}
    for c in cells:
        weights = c.directory / "train" / "model"
        if not (weights / "config.json").is_file():
            raise MissingFile(f"{weights} is missing (trained weights are not committed); re-run {rerun} to rebuild it")
        model = load(weights)
        out[str(variant_of(model))] = model
    return out


def with_rope(model: nn.Module, rope_type: str, factor: float, trained_len: int) -> nn.Module:
    """The model with RoPE scaling set through transformers' rope_parameters ("default", "linear" or
    "yarn", ``factor`` over ``trained_len``); rebuilds the rotary embedding in place."""
    config = config_of(model)
    base = {k: v for k, v in config.rope_parameters.items() if k in ("rope_theta", "partial_rotary_factor")}
    if rope_type == "default":
        config.rope_parameters = {**base, "rope_type": "default"}
        config.max_position_embeddings = trained_len
    else:
        config.rope_parameters = {
            **base,
            "rope_type": rope_type,
            "factor": float(factor),
            **({"original_max_position_embeddings": trained_len} if rope_type == "yarn" else {}),
        }
        config.max_position_embeddings = int(trained_len * factor)
    hf = cast(PreTrainedModel, model)
    inner = hf.get_decoder() if hasattr(model, "get_decoder") else cast(nn.Module, model.model)
    rotary = cast(nn.Module, inner.rotary_emb)
    inner.rotary_emb = type(rotary)(config=config).to(next(model.parameters()).device)
    return model


PAIR = {"--pair": ("results/cpu_recipe", "study run whose trained tiny models (seed 0) to use")}


def script_args(doc: str, out: str, **extra: tuple[object, str]) -> argparse.Namespace:
    """The experiment scripts' command line: --smoke, --out (default ``out``) and ``extra``
    ({flag: (default, help)})."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny random models, short inputs (CI)")
    ap.add_argument("--out", default=out)
    for flag, (default, help_) in extra.items():
        ap.add_argument(flag, default=default, help=help_)
    return ap.parse_args()


def save_figure(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    save_png(fig, path)


def header(title: str, command: str, seconds: float, what: str) -> list[str]:
    """The first lines of an experiment's report.md: what it asks, how to regenerate it, where it ran."""
    m = machine()
    where = m.gpu or f"{m.cpus} CPUs ({m.torch_threads} torch threads), no GPU"
    return [
        f"# {title}",
        "",
        what.strip(),
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min wall). Machine: {m.platform}, {where}; "
        + ", ".join(f"{k} {v}" for k, v in versions().items() if v)
        + ".",
        "",
    ]


def write(out: Path, lines: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
