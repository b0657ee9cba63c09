"""Evaluation through lm-eval: in-memory float or quantized models, bundled offline tasks, masked LMs.

``qg.evaluate(model, tokenizer, tasks)`` wraps the model in lm-eval's HFLM (causal LMs) or in
``quantgate-mlm`` (masked LMs, scored by pseudo-log-likelihood, Salazar et al. 2020) and runs
``lm_eval.simple_evaluate`` with quantgate's task folder on the include path:

* ``quantgate_ppl``: loglikelihood_rolling over the held-out test documents (word_perplexity,
  byte_perplexity, bits_per_byte);
* ``quantgate_cloze``: LAMBADA-style last word (perplexity, acc);
* ``quantgate_nextsent``: 4-way next sentence (acc, acc_norm);
* ``quantgate_mlm_ppl`` (masked LMs): exp of the mean cross-entropy on 15% masked tokens of the test
  split with a fixed masking seed, as Bondarenko et al. report; computed here, since lm-eval has no
  masked-LM request type.
* ``quantgate_backcopy`` (causal LMs trained on the synthetic backcopy task): perplexity and the
  accuracy of the copied tokens (the one place the task needs attention) on held-out sequences of
  the same task; computed here.
Standard lm-eval tasks (wikitext, lambada_openai, hellaswag, ...) pass straight through online.

Besides each task's metrics, the result keeps each document's values (``result["documents"][task]``,
columns as :mod:`quantgate.stats` reads them): the summed log-likelihood with the document's words,
bytes and tokens for perplexity tasks, acc (and acc_norm) per item for multiple-choice and cloze tasks,
the summed log-likelihood and token count per sequence for the computed tasks. From them
:func:`quantgate.stats.paired_delta` puts an interval on the change between two evaluations.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from .data import batches
from .data.corpus import OfflineError, hub_reachable
from .data.synthetic import BackcopyBatches
from .models.families import family_of
from .models.modes import eval_mode
from .models.sources import tokenizer as get_tokenizer
from .models.swap import variant_of
from .provenance import versions
from .stats import METRICS, aggregate

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

__all__ = ["evaluate", "check_limit", "BUNDLED_TASKS", "mlm_perplexity", "mlm_documents", "backcopy_metrics"]

log = logging.getLogger("quantgate")
TASK_DIR = Path(__file__).with_name("tasks")
BUNDLED_TASKS = ("quantgate_ppl", "quantgate_cloze", "quantgate_nextsent", "quantgate_mlm_ppl", "quantgate_backcopy")
COMPUTED_TASKS = ("quantgate_mlm_ppl", "quantgate_backcopy")  # scored here, not through lm-eval
BACKCOPY_HELD_OUT_SEED = 1_000_003
OFFLINE_EQUIVALENTS = {
    "wikitext": "quantgate_ppl",
    "lambada_openai": "quantgate_cloze",
    "lambada_standard": "quantgate_cloze",
    "hellaswag": "quantgate_nextsent",
    "piqa": "quantgate_nextsent",
    "arc_easy": "quantgate_nextsent",
    "arc_challenge": "quantgate_nextsent",
    "winogrande": "quantgate_nextsent",
}


@lru_cache(maxsize=2)
def task_manager(include_defaults: bool = True) -> TaskManager:
    """lm-eval's task index with quantgate's tasks; without lm-eval's own ~10k task configs (slow to
    index) when only bundled tasks are asked for."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager  # lm-eval is optional: imported at first use

    return TaskManager(include_path=str(TASK_DIR), include_defaults=include_defaults)


def check_limit(limit: int | float | None) -> int | float | None:
    """lm-eval's ``limit``: None (every document), a whole number of documents >= 1, or a fraction in (0, 1)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"limit must be a number of documents (>= 1) or a fraction in (0, 1), got {limit!r}")
    if limit >= 1 and limit != int(limit):
        raise ValueError(f"limit {limit} is neither a whole number of documents nor a fraction below 1")
    return int(limit) if limit >= 1 else float(limit)


def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tasks: str | Iterable[str] = ("quantgate_ppl",),
    *,
    limit: int | float | None = None,
    batch_size: int | str = "auto",
    max_length: int | None = None,
) -> dict:
    """Evaluate ``model`` on lm-eval ``tasks``; returns ``{"results": {task: {metric: value}},
    "documents": {task: {column: [one value per document]}}, "settings": ..., "versions": ...}`` with what
    is needed to reproduce the numbers."""
    limit = check_limit(limit)
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model)
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    family = family_of(model)
    _check_vocabulary(model, tokenizer)
    _check_tasks(tasks, family.objective)
    if batch_size == "auto":
        batch_size = 8 if next(model.parameters()).device.type == "cpu" else "auto"
    max_length = max_length or _context_length(model)
    results: dict[str, dict] = {}
    documents: dict[str, dict] = {}
    lm_tasks = [t for t in tasks if t not in COMPUTED_TASKS]
    if lm_tasks:
        lm_eval = _require_lm_eval()
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices about custom datasets
        lm = _wrap(model, tokenizer, family.objective, batch_size, max_length)
        with eval_mode(model):
            manager = task_manager(include_defaults=any(t not in BUNDLED_TASKS for t in lm_tasks))
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=lm_tasks,
                task_manager=manager,
                limit=limit,
                log_samples=True,
                bootstrap_iters=0,
                verbosity="ERROR",
            )
        results.update({task: _clean(metrics) for task, metrics in out["results"].items()})
        documents.update(
            {
                task: _documents(samples, out["configs"][task], tokenizer)
                for task, samples in out["samples"].items()
                if samples
            }
        )
    if "quantgate_mlm_ppl" in tasks:
        documents["quantgate_mlm_ppl"] = mlm_documents(model, tokenizer, limit=limit)
        results["quantgate_mlm_ppl"] = {"perplexity": aggregate(documents["quantgate_mlm_ppl"], "perplexity")}
    if "quantgate_backcopy" in tasks:
        documents["quantgate_backcopy"] = _backcopy_documents(model, tokenizer, limit=limit)
        results["quantgate_backcopy"] = _backcopy_results(documents["quantgate_backcopy"])
    quant = (getattr(model.config, "quantgate", None) or {}).get("quantization")
    return {
        "results": results,
        "documents": documents,
        "settings": {
            "tasks": tasks,
            "limit": limit,
            "batch_size": batch_size,
            "max_length": max_length,
            "model": getattr(model.config, "_name_or_path", None) or None,
            "family": family.name,
            "variant": str(variant_of(model)),
            "quantization": quant["scheme"] if quant else None,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
        "versions": {
            **versions(("quantgate", "lm_eval", "torch", "transformers", "torchao")),
            "python": platform.python_version(),
        },
    }


def _require_lm_eval():
    """lm_eval, imported where it is used: it is optional (the tasks scored here run without it)."""
    try:
        import lm_eval  # lm-eval is optional: imported at first use
    except ImportError as e:
        raise ModuleNotFoundError(f"evaluation needs lm-eval (pip install lm-eval==0.4.13): {e}") from None
    return lm_eval


def _check_vocabulary(model, tokenizer) -> None:
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}: they do not "
            f"belong together; use qg.tokenizer(model)"
        )


def _check_tasks(tasks: list[str], objective: str) -> None:
    if not tasks:
        raise ValueError(f"no tasks given; bundled: {', '.join(BUNDLED_TASKS)}")
    if "quantgate_mlm_ppl" in tasks and objective != "mlm":
        raise ValueError("quantgate_mlm_ppl scores masked LMs; use quantgate_ppl for causal LMs")
    if "quantgate_backcopy" in tasks and objective != "clm":
        raise ValueError("quantgate_backcopy scores causal LMs trained on the backcopy task")
    unknown = unknown_tasks(tasks)
    if unknown:
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}; bundled (offline): {', '.join(BUNDLED_TASKS)}; "
            f"any lm-eval task name works online (lm-eval ls tasks)"
        )
    remote = [t for t in tasks if t not in BUNDLED_TASKS]
    if remote and not hub_reachable():
        hints = ", ".join(f"{t} -> {OFFLINE_EQUIVALENTS[t]}" for t in remote if t in OFFLINE_EQUIVALENTS)
        raise OfflineError(
            f"task(s) {', '.join(remote)} download their data from the Hugging Face hub, which is not "
            f"reachable. Offline, use the bundled tasks: {', '.join(BUNDLED_TASKS)}" + (f" ({hints})" if hints else "")
        )


def unknown_tasks(tasks: Iterable[str]) -> list[str]:
    """The names that are neither bundled nor lm-eval tasks (lm-eval's index is read only when needed)."""
    others = [t for t in tasks if t not in BUNDLED_TASKS]
    if not others:
        return []
    known = set(task_manager().all_tasks)
    return [t for t in others if t not in known]


def _context_length(model: nn.Module) -> int:
    return int(min(getattr(model.config, "max_position_embeddings", 2048) or 2048, 4096))


def _wrap(model, tokenizer, objective: str, batch_size, max_length):
    if objective == "mlm":
        return _register()(model, tokenizer, batch_size=batch_size, max_length=max_length)
    from lm_eval.models.huggingface import HFLM  # lm-eval is optional: imported at first use

    try:
        # add_bos_token=False: lm-eval itself puts BOS (its prefix token) before each rolling window; a
        # tokenizer that also prepends BOS would score a spurious extra token
        return HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=max_length,
            backend="causal",
            add_bos_token=False,
        )
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"lm-eval cannot wrap this {type(model).__name__}: {e}") from None


def _clean(metrics: dict) -> dict:
    """lm-eval's ``{"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...}`` -> ``{"acc": 0.5}``."""
    out = {}
    for key, value in metrics.items():
        name = key.split(",")[0]
        if key != "alias" and isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            out[name] = float(value)
    return out


def _documents(samples: list[dict], config: dict, tokenizer) -> dict:
    """Per-document values of one lm-eval task from its logged samples (one filter: the first): the
    per-document value of each metric quantgate.stats aggregates, split where lm-eval logs a pair
    (word_perplexity: (loglikelihood, words)), and for rolling log-likelihood tasks the token count."""
    rows = [s for s in samples if s["filter"] == samples[0]["filter"]]
    docs = {"ids": [s["doc_id"] for s in rows]}
    for name, metric in METRICS.items():
        if name not in rows[0]:
            continue
        values = [s[name] for s in rows]
        if isinstance(values[0], (tuple, list)):  # a weighted aggregation's (value, weight)
            assert metric.weight is not None  # lm-eval logs pairs for the weighted metrics only
            docs[metric.value], docs[metric.weight] = [_number(v[0]) for v in values], [_number(v[1]) for v in values]
        else:
            docs[metric.value] = [_number(v) for v in values]
    if config.get("output_type") == "loglikelihood_rolling":  # every token of the text is scored once
        docs["tokens"] = [len(tokenizer(s["arguments"][0][0], add_special_tokens=False).input_ids) for s in rows]
    return docs


def _number(v) -> int | float:
    """A JSON-compact number: whole values (hits, counts) as int."""
    v = float(v)
    return int(v) if v.is_integer() else v


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
) -> dict:
    """Per sequence: the log-likelihood summed over its masked positions, and how many there are."""
    data = batches(tokenizer, split, seq_len, batch_size, "mlm", seed=seed)
    n = len(data) if limit is None else max(1, int(limit if limit >= 1 else limit * len(data)))
    loglik, tokens = [], []
    device = next(model.parameters()).device
    with eval_mode(model):
        for i, batch in enumerate(data):
            if i >= n:
                break
            logits = model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits.float()
            labels = batch["labels"].to(device)
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            loglik += (-nll.sum(1)).tolist()
            tokens += (labels != -100).sum(1).tolist()
    return {"ids": list(range(len(loglik))), "loglikelihood": loglik, "tokens": tokens}


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
    return _backcopy_results(_backcopy_documents(model, tokenizer, seq_len=seq_len, batch_size=batch_size, limit=limit))


def _backcopy_results(docs: dict) -> dict:
    return {"perplexity": aggregate(docs, "perplexity"), "copy_acc": aggregate(docs, "copy_acc")}


@torch.no_grad()
def _backcopy_documents(
    model: nn.Module, tokenizer, *, seq_len: int = 128, batch_size: int = 16, limit: int | float | None = None
) -> dict:
    """Per held-out sequence: summed log-likelihood and count of its predicted tokens, greedy hits on
    and count of its copied tokens."""
    task = (getattr(model.config, "quantgate", None) or {}).get("task", "backcopy")  # recorded by train
    data = batches(
        tokenizer,
        task,
        seq_len,
        batch_size,
        seed=BACKCOPY_HELD_OUT_SEED,
        max_batches=int(limit) if limit and limit >= 1 else 8,
    )
    assert isinstance(data, BackcopyBatches)  # train records only backcopy tasks, and backcopy is the default
    device = next(model.parameters()).device
    docs: dict[str, list[float]] = {"ids": [], "loglikelihood": [], "tokens": [], "copied": [], "copies": []}
    with eval_mode(model):
        for batch in data:
            ids = batch["input_ids"].to(device)
            logits = model(input_ids=ids).logits.float()[:, :-1]
            target = ids[:, 1:]
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            copy = data.copy_positions(ids)[:, 1:]
            docs["loglikelihood"] += (-nll.sum(1)).tolist()
            docs["tokens"] += [target.shape[1]] * len(target)
            docs["copied"] += ((logits.argmax(-1) == target) & copy).sum(1).tolist()
            docs["copies"] += copy.sum(1).tolist()
    docs["ids"] = list(range(len(docs["tokens"])))
    return docs


@lru_cache(maxsize=1)
def _register():
    """Define PseudoLogLikelihoodLM and register it with lm-eval as ``quantgate-mlm``, at first use."""
    _require_lm_eval()
    from lm_eval.api.model import LM  # lm-eval is optional: imported at first use
    from lm_eval.api.registry import register_model  # lm-eval, likewise

    @register_model("quantgate-mlm")
    class PseudoLogLikelihoodLM(LM):
        """lm-eval model for masked LMs: a text's log-likelihood is its pseudo-log-likelihood, the sum
        over its tokens of log p(token | all other tokens) with that token masked (Salazar et al. 2020).
        ``loglikelihood(context, continuation)`` sums over the continuation's tokens with the context
        visible; ``is_greedy`` says whether every continuation token is the masked argmax."""

        def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int = 512):
            super().__init__()
            if tokenizer.mask_token_id is None or tokenizer.cls_token_id is None:
                raise ValueError("pseudo-log-likelihood needs a tokenizer with [MASK], [CLS] and [SEP] (a BERT one)")
            self.model, self.tok = model, tokenizer
            self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
            self.max_length = max_length
            self._device = next(model.parameters()).device

        def _pll(self, context_ids: list[int], target_ids: list[int]) -> tuple[float, bool]:
            """Sum of log p(target token | rest) over the target tokens, masking one at a time."""
            body = self.max_length - 2
            context_ids = context_ids[-max(body - len(target_ids), 0) :] if body > len(target_ids) else []
            target_ids = target_ids[-body:]
            ids = torch.tensor([self.tok.cls_token_id, *context_ids, *target_ids, self.tok.sep_token_id])
            positions = torch.arange(1 + len(context_ids), 1 + len(context_ids) + len(target_ids))
            total, greedy = 0.0, True
            for chunk in positions.split(self.batch_size):
                batch = ids.repeat(len(chunk), 1)
                batch[torch.arange(len(chunk)), chunk] = self.tok.mask_token_id
                logits = self.model(input_ids=batch.to(self._device)).logits.float()
                logp = logits[torch.arange(len(chunk)), chunk].log_softmax(-1)
                truth = ids[chunk].to(self._device)
                total += float(logp.gather(1, truth[:, None]).sum())
                greedy &= bool((logp.argmax(-1) == truth).all())
            return total, greedy

        def _encode(self, text: str) -> list[int]:
            return self.tok(text, add_special_tokens=False).input_ids

        @torch.no_grad()
        def loglikelihood(self, requests):
            return [self._pll(self._encode(r.args[0]), self._encode(r.args[1])) for r in requests]

        @torch.no_grad()
        def loglikelihood_rolling(self, requests):
            out = []
            for r in requests:
                ids, body, total = self._encode(r.args[0]), self.max_length - 2, 0.0
                for start in range(0, len(ids), body):  # disjoint windows, each scored in full
                    total += self._pll([], ids[start : start + body])[0]
                out.append(total)
            return out

        def generate_until(self, requests):
            raise NotImplementedError("masked LMs do not generate text: use loglikelihood or multiple-choice tasks")

    return PseudoLogLikelihoodLM


def __getattr__(name: str):
    if name == "PseudoLogLikelihoodLM":  # defined on first access, so that importing quantgate needs no lm-eval
        return _register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
