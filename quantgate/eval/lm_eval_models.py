"""quantgate's models as lm-eval models, and ``quantgate lm-eval``: lm-eval's own command line with them.

Importing this module (it imports lm-eval) registers two models in lm-eval's model registry:

* ``quantgate`` (:class:`QuantgateLM`, an HFLM subclass, so every request type lm-eval has works):
  causal LMs. ``pretrained=NAME`` is a directory, packaged checkpoint or preset, loaded by
  :func:`quantgate.eval.load.load_for_eval` (:func:`quantgate.load`, never transformers' AutoModel:
  quantgate's gated and quantized checkpoints are not plain transformers models), the loader
  ``quantgate eval`` uses; ``scheme=S`` quantizes it after calibrating as ``quantgate eval --scheme``
  does (train split, 128-token sequences, batches of 8); ``variant=V`` swaps an attention variant in
  first; ``dtype=float32|bfloat16|float16`` loads in that dtype. HFLM's other options pass through.
* ``quantgate-mlm`` (:class:`PseudoLogLikelihoodLM`): masked LMs, scored by pseudo-log-likelihood;
  the same ``pretrained``, ``scheme``, ``variant`` and ``dtype``.

lm-eval 0.4.13 has no plugin mechanism for models: its registry (lm_eval.api.registry) is filled from
lm_eval.models.MODEL_MAPPING and from ``@register_model`` in imported code, it reads no entry-point
group (its registry accepts an importlib EntryPoint as a lazy target, but nothing discovers them),
and ``--include_path`` adds tasks only. So ``lm_eval --model quantgate`` cannot find these models,
and :func:`main` (``quantgate lm-eval ARGS``) runs lm-eval's own command line
(``lm_eval.__main__.cli_evaluate``) in a process that has imported this module, with ARGS unchanged
but for ``--include_path`` set to quantgate's task folder when ARGS name none. ``--model_args`` splits
on commas, so a scheme or variant with options of its own goes in lm-eval's JSON form:
``--model_args '{"pretrained": "DIR", "scheme": "w8a8-int8-static:calib=4,a_bits=6"}'``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import PreTrainedTokenizerBase

from ..errors import InputError
from ..files import writable_dir, write_text_atomic
from ..models.families import family_of
from ..models.io import DTYPES
from ..models.sources import check_vocabulary
from ..models.sources import tokenizer as get_tokenizer
from ..models.swap import variant_of
from ..quant import quantization_of
from .checks import NonFiniteOutputs, check_lm_eval_options, first_non_finite, score_floats
from .load import context_length, load_for_eval
from .tasks import TASK_DIR

__all__ = ["QuantgateLM", "PseudoLogLikelihoodLM", "main", "with_task_folder", "check_output_path"]

# HFLM options that only mean something when HFLM loads the model itself from a hub id or directory
_LOADING_OPTIONS = {
    "revision",
    "subfolder",
    "parallelize",
    "max_memory_per_gpu",
    "max_cpu_memory",
    "offload_folder",
    "tp_plan",
    "peft",
    "delta",
    "autogptq",
    "gptqmodel",
    "gguf_file",
    "use_fast_tokenizer",
    "backend",  # always causal here; masked LMs are quantgate-mlm
}
_HFLM_OPTIONS = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs", "pretrained"}


def _optional(value: object) -> str | None:
    """A model_args value: lm-eval turns ``scheme=`` or ``scheme=None`` into "" or None."""
    return None if value is None or str(value).strip() in ("", "None", "none") else str(value)


def _dtype(value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name in ("", "auto", "None", "none"):
        return None
    if name not in DTYPES:
        raise InputError(f"dtype {value!r}: quantgate models load as {', '.join(DTYPES)} (or auto)")
    return DTYPES[name]


def _load(pretrained: object, scheme: object, variant: object, dtype: object, device: object, kind: str) -> nn.Module:
    """The model behind ``pretrained``: an in-memory model as it is, or a name loaded by load_for_eval."""
    if isinstance(pretrained, nn.Module):
        given = [k for k, v in (("scheme", scheme), ("variant", variant), ("dtype", dtype)) if _optional(v)]
        if given:
            raise InputError(
                f"{', '.join(given)} apply to a model loaded by name (pretrained=DIR_OR_PRESET); "
                f"quantize or convert an in-memory model before handing it to {kind}"
            )
        return pretrained
    if _optional(pretrained) is None:
        raise InputError(f"{kind} needs pretrained=NAME: a model directory, packaged checkpoint or preset")
    return load_for_eval(
        str(pretrained),
        _optional(variant),
        _optional(scheme),
        dtype=_dtype(dtype),
        device=_device(device),
    )


def _device(value: object) -> str | None:
    """lm-eval's ``--device`` (default cuda:0) as HFLM takes it: one this machine lacks falls back to
    cuda if there is one, else the CPU; None keeps the model where it loads (the CPU)."""
    name = _optional(value)
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"device {value!r} is no torch device (cpu, cuda, cuda:0, mps)") from None
    present = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }.get(device.type, False)
    return str(device) if present else ("cuda" if torch.cuda.is_available() else "cpu")


def _source(pretrained: object, model: nn.Module) -> str | None:
    """The name the model was loaded from: ``pretrained``, or an in-memory model's ``_name_or_path``."""
    if pretrained is not None and not isinstance(pretrained, nn.Module):
        return str(pretrained)
    return getattr(model.config, "_name_or_path", None) or None


def _batch_size(model: nn.Module, batch_size: object) -> int | str:
    """lm-eval's batch size, with ``auto`` 8 on a CPU as in quantgate eval (lm-eval's search for the
    largest batch that fits is meant for GPU memory)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return 8 if next(model.parameters()).device.type == "cpu" else str(batch_size or "auto")
    if not str(batch_size).isdigit() or int(str(batch_size)) < 1:
        raise InputError(f"batch_size must be a whole number >= 1 or auto, got {batch_size!r}")
    return int(str(batch_size))


def _model_info(model: nn.Module, source: str | None) -> dict[str, Any]:
    """What lm-eval's results file records about the model (its ``config``), without hub look-ups."""
    quant = quantization_of(model)
    return {
        "model_num_parameters": sum(p.numel() for p in model.parameters()),
        "model_dtype": str(next(model.parameters()).dtype),
        "quantgate_source": source,
        "quantgate_family": family_of(model).name,
        "quantgate_variant": str(variant_of(model)),
        "quantgate_quantization": quant.scheme if quant else None,
    }


@contextmanager
def _quiet_hflm() -> Iterator[None]:
    """HFLM warns that an in-memory model ignores its loading options; here that is the design."""
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    level = hf_log.level
    hf_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_log.setLevel(level)


@register_model("quantgate")
class QuantgateLM(HFLM):
    """lm-eval's HFLM over a model quantgate loads (``pretrained=NAME``, optional ``scheme``, ``variant``,
    ``dtype``) or over an in-memory causal LM (``pretrained=model``). As in ``quantgate eval``: quantgate's
    tokenizer for the model, ``add_bos_token=False`` (lm-eval puts its prefix token, BOS, before each
    rolling window itself; a tokenizer adding BOS again would score a spurious token), ``max_length`` the
    model's positions (at most 4096), ``batch_size`` auto = 8 on a CPU, log-probabilities in float32 whatever the
    model's dtype (lm-eval sums a window's in the dtype of its log-softmax: in bfloat16 a document's sum came out
    rounded to bfloat16, -17548, about 0.08 pp of noise on a change over 18 documents; windows are summed in float64;
    float32 leaves a float32 model's scores as they were; ``softmax_dtype`` overrides). A NaN or inf score is refused
    (:func:`_finite`)."""

    refuse_non_finite = True

    def __init__(
        self,
        pretrained: str | nn.Module | None = None,
        scheme: str | None = None,
        variant: str | None = None,
        dtype: str | torch.dtype | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int | str | None = "auto",
        max_length: int | None = None,
        add_bos_token: bool = False,
        device: str | None = None,
        **options: Any,
    ) -> None:
        options.pop("trust_remote_code", None)  # lm-eval adds it for --trust_remote_code; quantgate runs none
        options.setdefault("softmax_dtype", torch.float32)
        refused = sorted(set(options) & _LOADING_OPTIONS)
        if refused:
            raise InputError(f"--model quantgate loads through quantgate.load; {', '.join(refused)} do not apply")
        unknown = sorted(set(options) - _HFLM_OPTIONS)
        if unknown:
            raise InputError(
                f"--model quantgate takes pretrained, scheme, variant, dtype and HFLM's options; "
                f"not {', '.join(unknown)}"
            )
        model = _load(pretrained, scheme, variant, dtype, device, "--model quantgate")
        source = _source(pretrained, model)
        if family_of(model).objective != "clm":
            raise InputError(f"{source or type(model).__name__} is a masked LM: use --model quantgate-mlm")
        if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise InputError("tokenizer: --model quantgate uses the model's own tokenizer (qg.tokenizer); omit it")
        tok = tokenizer if tokenizer is not None else get_tokenizer(model)
        check_vocabulary(model, tok)
        with _quiet_hflm():
            super().__init__(
                pretrained=model,
                tokenizer=tok,
                batch_size=_batch_size(model, batch_size),
                max_length=max_length or context_length(model),
                backend="causal",
                add_bos_token=add_bos_token,
                trust_remote_code=False,  # popped from options above: quantgate runs no checkpoint's code
                **options,
            )
        self.quantgate_source = source

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """HFLM's, refusing NaN or inf (:func:`_finite`)."""
        return _finite(self, "loglikelihood", requests, super().loglikelihood(requests, disable_tqdm))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """HFLM's, refusing NaN or inf (:func:`_finite`)."""
        scores = super().loglikelihood_rolling(requests, disable_tqdm)
        return _finite(self, "loglikelihood_rolling", requests, scores)

    def get_model_info(self) -> dict[str, Any]:
        """Parameters, dtype, source, family, variant and quantization scheme, for lm-eval's ``config``."""
        return _model_info(self._model, self.quantgate_source)


def _finite(lm: QuantgateLM | PseudoLogLikelihoodLM, kind: str, requests: list[Any], scores: list) -> list:
    """``scores`` (one per request: a float, or a (float, is_greedy) pair), unless one is NaN or inf: then
    :class:`NonFiniteOutputs` naming the request, before lm-eval aggregates or writes anything (lm-eval
    would write a NaN metric and exit 0). Not where ``lm.refuse_non_finite`` is False:
    :func:`quantgate.eval.evaluate.evaluate` checks lm-eval's samples itself, naming the task and keeping the tasks
    that scored."""
    if not lm.refuse_non_finite:
        return scores
    for i, score in enumerate(scores):
        value = score[0] if isinstance(score, tuple) else score
        if not math.isfinite(value):
            doc = getattr(requests[i], "doc_id", i)
            text = " ".join(str(a) for a in requests[i].args)[:40]
            raise NonFiniteOutputs(
                f"{kind} request {i + 1} of {len(requests)} (document {doc}: {text!r}) scored {value}: the "
                f"model's outputs are NaN or inf, so no metric of this run means anything; nothing was written. "
                f"Check the weights (quantgate info) and the scheme (quantgate quantize prints its error)",
                partial={},
            )
    return scores


@register_model("quantgate-mlm")
class PseudoLogLikelihoodLM(LM):
    """lm-eval model for masked LMs: a text's log-likelihood is its pseudo-log-likelihood, the sum
    over its tokens of log p(token | all other tokens) with that token masked (Salazar et al. 2020).
    ``loglikelihood(context, continuation)`` sums over the continuation's tokens with the context
    visible; ``is_greedy`` says whether every continuation token is the masked argmax.

    Built on an in-memory model (``PseudoLogLikelihoodLM(model, tokenizer)``) or by lm-eval from
    ``--model_args pretrained=NAME[,scheme=S][,variant=V][,dtype=D]`` (loaded as ``quantgate eval``
    loads it). ``batch_size``: masked copies per forward pass; ``max_length`` (tokens, default the
    model's positions) bounds each scored window, [CLS] and [SEP] included. A NaN or inf score is refused
    (:func:`_finite`)."""

    refuse_non_finite = True

    def __init__(
        self,
        model: nn.Module | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int | str | None = 16,
        max_length: int | None = None,
        *,
        pretrained: str | nn.Module | None = None,
        scheme: str | None = None,
        variant: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        options.pop("trust_remote_code", None)
        options.pop("max_batch_size", None)  # lm-eval passes it to every model; one batch size here
        if options:
            raise InputError(
                f"--model quantgate-mlm takes pretrained, scheme, variant, dtype, batch_size and max_length; "
                f"not {', '.join(sorted(options))}"
            )
        if model is not None and pretrained is not None:
            raise InputError("give the model or pretrained=NAME, not both")
        if model is None:
            model = _load(pretrained, scheme, variant, dtype, device, "--model quantgate-mlm")
            if family_of(model).objective != "mlm":
                raise InputError(f"{pretrained} is a causal LM: use --model quantgate")
        elif any(_optional(v) for v in (scheme, variant, dtype)):
            raise InputError("scheme, variant and dtype apply to a model loaded by name (pretrained=NAME)")
        tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model)
        if tokenizer.mask_token_id is None or tokenizer.cls_token_id is None:
            raise InputError("pseudo-log-likelihood needs a tokenizer with [MASK], [CLS] and [SEP] (a BERT one)")
        self.model, self.tok = model, tokenizer
        self.batch_size = int(str(batch_size)) if str(batch_size).isdigit() else 16
        self.max_length = max_length or context_length(model)
        self._device = next(model.parameters()).device
        self.quantgate_source = _source(pretrained, model)

    # a rank of a data-parallel run (quantgate.parallel.share_work) gathers and waits as HFLM does
    all_gather, gather_object, barrier = HFLM.all_gather, HFLM.gather_object, HFLM.barrier

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
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """Per request (context, continuation): the continuation's summed PLL (nats) and is_greedy."""
        scores = [self._pll(self._encode(r.args[0]), self._encode(r.args[1])) for r in requests]
        return _finite(self, "loglikelihood", requests, scores)

    @torch.no_grad()
    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Per request (text,): the text's summed PLL (nats) over disjoint windows of max_length - 2 tokens."""
        out = []
        for r in requests:
            ids, body, total = self._encode(r.args[0]), self.max_length - 2, 0.0
            for start in range(0, len(ids), body):  # disjoint windows, each scored in full
                total += self._pll([], ids[start : start + body])[0]
            out.append(total)
        return _finite(self, "loglikelihood_rolling", requests, out)

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Masked LMs do not generate: refused."""
        raise NotImplementedError("masked LMs do not generate text: use loglikelihood or multiple-choice tasks")

    def get_model_info(self) -> dict[str, Any]:
        """Parameters, dtype, source, family, variant and quantization scheme, for lm-eval's ``config``."""
        return _model_info(self.model, self.quantgate_source)


_HELP = ("-h", "--help")


def with_task_folder(argv: Sequence[str]) -> list[str]:
    """``argv`` for lm-eval's command line with ``--include_path`` quantgate's task folder appended when
    it names none (and it asks for more than help); otherwise unchanged."""
    args = list(argv)
    given = any(a == "--include_path" or a.startswith("--include_path=") or a.startswith("--incl") for a in args)
    if given or len(args) < 2 or any(a in _HELP for a in args):
        return args
    return [*args, "--include_path", str(TASK_DIR)]


def main(argv: Sequence[str]) -> int:
    """Run lm-eval's own command line (what ``lm_eval.__main__.cli_evaluate`` does) on ``argv`` with quantgate's
    models registered (this module's import) and its task folder on the include path
    (:func:`with_task_folder`); returns lm-eval's exit status (0, or 2 for a usage error). Two checks lm-eval
    lacks, for every model type (``hf`` too): ``--output_path`` is checked writable before anything loads
    (:func:`check_output_path`; lm-eval would run, log that it could not save and exit 0), and a NaN or inf
    result is refused before lm-eval writes or prints it (:func:`_refusing_non_finite`)."""
    import lm_eval
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    saved, evaluate = sys.argv, lm_eval.simple_evaluate
    sys.argv = ["lm-eval", *with_task_folder(argv)]
    try:
        setup_logging()
        parser = HarnessCLI()
        args = parser.parse_args()
        output_path = getattr(args, "output_path", None)  # `run`'s; `ls` and `validate` write nothing
        check_output_path(output_path)
        lm_eval.simple_evaluate = _refusing_non_finite(evaluate, output_path, bool(getattr(args, "log_samples", 0)))
        parser.execute(args)
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    finally:
        sys.argv, lm_eval.simple_evaluate = saved, evaluate
    return 0


def check_output_path(output_path: str | None) -> None:
    """lm-eval's ``--output_path`` (a directory, or a results file name ending in .json), refused in one line
    before the work where lm-eval could not write there: the checks of ``quantgate eval --output-path``
    (:func:`quantgate.eval.checks.check_lm_eval_options`, :func:`quantgate.files.writable_dir`)."""
    if output_path is None:
        return
    check_lm_eval_options(output_path=output_path)
    path = Path(output_path)
    writable_dir(path.parent if path.suffix == ".json" else path, "--output_path", create=False)


PARTIAL = "lm_eval.partial.json"  # not results_*.json: quantgate compare must not take it for a run


def _refusing_non_finite(evaluate: Callable[..., Any], output_path: str | None, log_samples: bool) -> Callable:
    """``lm_eval.simple_evaluate`` as lm-eval's command line calls it, raising :class:`NonFiniteOutputs` where a
    task's metric or one of its documents' scores is NaN or inf, before lm-eval writes or prints its results
    (it would write ``word_perplexity NaN``, or an accuracy from NaN scores, and exit 0). lm-eval keeps the
    samples for the check (and drops them after, unless ``--log_samples`` asked for them); what was computed is
    kept in :data:`PARTIAL` under ``output_path`` and named in the error."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        kwargs["log_samples"] = True
        out = evaluate(*args, **kwargs)
        if out is None:  # a rank other than the first of a data-parallel run
            return out
        samples = out.get("samples") if log_samples else out.pop("samples", None)
        bad = _non_finite(out, samples or {})
        if bad:
            raise NonFiniteOutputs(_refusal(out, bad, _keep(out, samples if log_samples else None, output_path)), out)
        return out

    return checked


def _non_finite(out: dict, samples: dict) -> dict[str, list[str]]:
    """Per task (or group), what is NaN or inf: its metrics (not their stderrs) and its first document whose
    scores are (lm-eval turns NaN log-likelihoods into an accuracy as readily as into a NaN perplexity)."""
    bad: dict[str, list[str]] = {}
    for section in ("results", "groups"):
        for task, metrics in (out.get(section) or {}).items():
            for key, value in metrics.items():
                name = key.split(",")[0]
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if number and not name.endswith("_stderr") and not math.isfinite(value):
                    bad.setdefault(task, []).append(f"{name} {value}")
    for task, rows in samples.items():
        found = first_non_finite([(r.get("doc_id"), score_floats(r.get("resps"))) for r in rows])
        if found is not None:
            bad.setdefault(task, []).append(f"document {found[0]} scores {found[1]}")
    return bad


def _refusal(out: dict, bad: dict[str, list[str]], kept: Path | None) -> str:
    """The one-line error: the first task and what of it is non-finite, the others counted, what scored finite."""
    task, what = next(iter(bad.items()))
    more = [t for t in bad if t != task]
    finite = [
        f"{t}/{k.split(',')[0]} {v:.4g}"
        for t, metrics in (out.get("results") or {}).items()
        if t not in bad
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in k
    ]
    return (
        f"{task}: {', '.join(what)}"
        + (f" (and {len(more)} more task(s): {', '.join(more)})" if more else "")
        + ": the model's outputs are NaN or inf, so these metrics mean nothing; lm-eval's results were neither "
        "written nor printed. Check the weights (quantgate info) and the quantization. "
        + (f"Scored finite: {', '.join(finite)}. " if finite else "No task scored finite. ")
        + (f"Everything lm-eval computed: {kept}" if kept else "Give --output_path to keep what was computed")
    )


def _keep(out: dict, samples: dict | None, output_path: str | None) -> Path | None:
    """lm-eval's results (non-finite values as the strings ``nan``, ``inf``; with ``samples`` those too) in
    :data:`PARTIAL` in the ``--output_path`` folder; None without one."""
    if output_path is None:
        return None
    from lm_eval.utils import handle_non_serializable

    def plain(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    kept = {k: v for k, v in out.items() if k != "samples"} | ({"samples": samples} if samples is not None else {})
    path = Path(output_path)
    file = (path.parent if path.suffix == ".json" else path) / PARTIAL
    write_text_atomic(file, json.dumps(plain(kept), indent=2, default=handle_non_serializable, ensure_ascii=False))
    return file
