"""``quantgate audit MODEL``: will this checkpoint survive INT8/FP8, and what should I do about it?

An audit is a generated study (:mod:`quantgate.study`), not a second pipeline:

1. It reads the checkpoint's config and refuses, in one line, a folder that is not a model, a family quantgate
   cannot swap, and a model too large for this machine's memory without ``--device-map``.
2. It times a forward pass of the model on this machine and sizes the number of documents so that the float
   evaluation, the observation and the whole climbing ladder fit ``budget`` (a budget too small for any interval
   is refused, naming the smallest that would do).
3. It climbs :data:`LADDER`, cheapest at run time first. Each rung adds one scheme to ``DIR/audit.yaml`` and runs
   that study: its cached steps are reused, so each run computes only the new rung, and the run is resumable.
   It stops at the first rung whose whole 95% interval (paired over the same documents) lies below ``within``;
   with time left, it then tries the probes (fewer bits). What the budget cut is stated. A rung the model cannot
   run (INT4's groups of 128 on SmolLM2's width of 576) is left out of the default ladder, and logged.
4. It writes ``DIR/audit.md`` (the answer first: static INT8 or not, the cheapest recipe within the tolerance,
   why), and the recipe as an export (``DIR/export``): in a format transformers and vLLM load where one holds
   it (else the next recipe within that one does), in quantgate's own format where none does (a gated model).

``quantgate study DIR/audit.yaml`` reruns the study from its cache (the file names ``out: .``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from .checkpoint import load, save
from .data.corpus import corpus, in_turn
from .data.synthetic import is_backcopy
from .errors import InputError
from .evaluate import BUNDLED_TASKS, unknown_tasks
from .files import claim_output, folder_name, read_json, write_text_atomic
from .models.families import Family, family_of
from .models.io import DTYPES, Placement, meta_model, read_config
from .models.record import record_of
from .models.sources import PACKAGED, is_hub_id, resolve
from .models.sources import tokenizer as get_tokenizer
from .quant.export import export_format
from .quant.imported import quantization_config
from .quant.schemes import get_scheme
from .stats import MIN_CLUSTERS, Delta, format_delta
from .study.fixes import LOW_PRECISION_DTYPES, verdict
from .study.grid import DataSettings
from .study.measures import PPL_KEYS, change_gap, gap_reading, max_layer_sink, peak_activation, ppl_change
from .study.records import CellRecord, read_metrics
from .study.steps import quantize_calibrated, run_study
from .yaml_file import yaml_text

__all__ = ["audit", "Audit", "Rung", "LADDER", "AuditError", "parse_budget", "parse_within"]

log = logging.getLogger("quantgate")


class AuditError(InputError):
    """An audit that cannot run as asked; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Rung:
    """A scheme on the audit's ladder and what it costs at run time, in words; a ``probe`` (fewer bits) is
    tried only once a recipe is found and time is left."""

    scheme: str
    bits: str  # weights / activations
    work: str
    probe: bool = False


LADDER: tuple[Rung, ...] = (
    Rung("w8a8-int8-static", "W8A8", "per-tensor static INT8: scales fixed at calibration, nothing read at run time"),
    Rung("w8a8-int8-static:smooth=0.5", "W8A8", "SmoothQuant folded into the weights: static INT8's run time"),
    Rung("w8a8-fp8-e4m3", "W8A8", "per-tensor static FP8 E4M3: static INT8's run time on FP8 hardware"),
    Rung("w8a8-int8-dynamic", "W8A8", "per-token INT8: every token's range read at run time"),
    Rung("w8a8-int8-dynamic:smooth=0.5", "W8A8", "SmoothQuant, then per-token INT8"),
    Rung("w8a8-int8-dynamic:rotate=online", "W8A8", "Hadamard rotations, then per-token INT8: extra transforms"),
    Rung("w8-int8", "W8A16", "weight-only INT8: activations stay 16-bit"),
    Rung("w4a4-nvfp4", "W4A4", "NVFP4 weights and activations (FP4 hardware)", probe=True),
    Rung("w4-int4-group", "W4A16", "weight-only INT4 in groups of 128", probe=True),
)
GPU_RUNGS = (  # real kernels, measured where torchao and a GPU are present: after per-token INT8
    Rung("torchao-int8-dynamic", "W8A8", "torchao's INT8 dynamic kernels"),
)
REFERENCE = LADDER[0].scheme  # the question: per-tensor static INT8
MIN_DOCS = MIN_CLUSTERS  # documents in turn from 9 works: fewer give an approximate interval and no verdict
BATCH_TASKS = ("quantgate_backcopy", "quantgate_mlm_ppl")  # a limit counts batches of 16 independent sequences
# the most a limit reads (the main job's sizes): documents of text; batches of 16 x 128 tokens for the others
MAX_DOCS = {"quantgate_ppl": 24, "quantgate_mlm_ppl": 8, "quantgate_backcopy": 8}
SAFETY = 0.85  # the share of the budget the plan fills: estimates err
# a simulated scheme's step over the float evaluation, until one is measured: 1.4 for INT8 on SmolLM2 here, 2.5
# for FP8 (results/bench/audit-smollm2-cpu.md), so that the whole ladder fits
FIRST_RATIO = 2.0
BATCH_TOKENS = 16 * 128  # a backcopy or masked-LM limit unit: a batch of 16 sequences of 128 tokens


def parse_budget(text: str | float | int) -> float:
    """Seconds in ``text``: ``90s``, ``10m``, ``1h``, ``1h30m`` or a plain number of seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", s)
        if not s or parts is None:
            raise AuditError(f"--budget {text!r}: give a duration such as 90s, 10m or 1h")
        h, m, sec = (float(x) if x else 0.0 for x in parts.groups())
        seconds = 3600 * h + 60 * m + sec
    if not seconds > 0:
        raise AuditError(f"--budget {text!r} must be more than 0 seconds")
    return seconds


def parse_within(text: str | float) -> float:
    """A tolerance as a fraction of the float perplexity: ``1%`` or ``0.01``."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise AuditError(f"--within {text!r}: give a perplexity change such as 1% or 0.01") from None
    if not 0 < value < 1 or (not s.endswith("%") and value >= 1):
        raise AuditError(f"--within {text!r}: give a change between 0 and 100%, such as 1% or 0.01")
    return value


# --- what is audited -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One model of the audit: its study name, where it loads from and in what."""

    name: str
    load: str  # a packaged name, a hub id or an absolute folder
    folder: Path
    config: Any  # its transformers config, read once
    family: Family
    variant: str | None  # the gated variant it was saved with, None for an ungated model
    task: str | None  # the synthetic task it was trained on (its evaluation), None for text


def _target(model: str, variant: str | None) -> Target:
    """The float checkpoint ``model`` names, checked: a model folder, of a family quantgate swaps, not quantized."""
    text = str(model)
    path = Path(text)
    if path.is_dir() and not (path / "config.json").is_file() and not (path / "model" / "config.json").is_file():
        raise AuditError(
            f"{path} is not a model folder: it has no config.json; give a folder written by save_pretrained or "
            f"qg.save, a packaged model ({', '.join(PACKAGED)}) or a hub id in the local cache"
        )
    try:
        folder = _cached_hub_snapshot(text) if is_hub_id(text) else resolve(text)
        config = read_config(folder)
    except (FileNotFoundError, ValueError) as e:
        raise AuditError(str(e)) from None
    try:
        family = family_of(config)
    except ValueError as e:
        raise AuditError(f"{folder}: cannot audit it: {e}") from None
    source = _float_source(folder, config)
    if source is not None:
        return _target(source, variant)
    record = record_of(config)
    saved = record.variant if record.variant and record.variant != "vanilla" else None
    packaged = PACKAGED.get(text)
    name = text if packaged else folder_name(path.resolve().name if path.is_dir() else text.split("/")[-1], "model")
    load_from = text if packaged else str(folder.resolve())  # a hub id: its snapshot in the local cache
    task = record.task or (packaged.task if packaged else None)
    return Target(name, load_from, folder, config, family, variant or saved, task)


def _cached_hub_snapshot(repo_id: str) -> Path:
    """The local cache's snapshot of hub repository ``repo_id``; an audit downloads nothing."""
    from huggingface_hub import snapshot_download

    try:
        return resolve(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), or not a repository id
        raise AuditError(
            f"{repo_id!r} is not in the local Hugging Face cache ({type(e).__name__}); an audit downloads nothing: "
            f"fetch it first (hf download {repo_id}) or give a folder"
        ) from None


def _float_source(folder: Path, config: Any) -> str | None:
    """The float checkpoint a quantized one was made from, where it names one that is here; None for a float
    checkpoint. A quantized checkpoint whose source is not here is refused, saying what to give instead."""
    record = record_of(config)
    imported = quantization_config(config)
    if not record.quantization and imported is None:
        return None
    sidecar = folder / "quantization.json"
    named = None
    if sidecar.is_file():
        try:
            named = read_json(sidecar).get("source_model")
        except ValueError:
            named = None
    own = record.quantization.scheme if record.quantization else None
    what = own or (imported or {}).get("quant_method", "quantized")
    if isinstance(named, str) and named and (named in PACKAGED or Path(named).is_dir()):
        return named
    hint = f" its quantization.json names {named!r}, which is not here;" if named else ""
    raise AuditError(
        f"{folder} is already quantized ({what}), and an audit compares a float model with its quantized "
        f"forms:{hint} give the float checkpoint it was made from (quantgate compare sets a quantized "
        f"checkpoint against its float one)"
    )


def _dtype_of(target: Target, dtype: str | None) -> str:
    """``dtype`` or the checkpoint's own (config.json's ``dtype``) where quantgate evaluates in it; else float32."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise AuditError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
        return dtype
    data = read_json(target.folder / "config.json")
    stored = data.get("dtype") or data.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def _free_memory() -> int:
    """Bytes of memory a new allocation can take here: Linux's MemAvailable, else the free pages."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), flags=re.M)
        if found:
            return int(found.group(1)) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_memory(target: Target, dtype: str, placement: Placement | None) -> None:
    """Refuse a model whose float copy and quantized copy do not fit in the memory free where the study runs it
    (the GPU where there is one, else the CPU) unless ``placement`` shards it."""
    params = sum(p.numel() for p in meta_model(target.family, target.config).parameters())
    need = int(params * DTYPES[dtype].itemsize * 2.5)  # the float model, a quantized copy, a quarter for the rest
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else _free_memory()  # where the cells run it
    if placement is None and need > free:
        raise AuditError(
            f"{target.name} has {params / 1e9:.2f} B parameters: a float and a quantized copy in {dtype} need about "
            f"{need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free here; load it sharded with "
            f"--device-map auto (and --max-memory, --offload-folder where needed)"
        )


# --- sizing the audit to its budget ------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What one model reads: the evaluation tasks (the first decides) and window, calibration and observation."""

    tasks: list[str]
    max_length: int | None
    calibration: dict[str, Any]
    observe: dict[str, Any]
    batch_size: int | str = 1

    def tokens(self, section: str) -> int:
        d = self.calibration if section == "calibration" else self.observe
        return int(d["batches"] * d["seq_len"] * d["batch_size"])


def _settings(target: Target, tasks: list[str] | None) -> Settings:
    """The main job's settings for a model of this kind: text for a pretrained model, the backcopy task for one
    trained on it, masked-LM perplexity for an encoder. The verdicts read a perplexity (``PPL_KEYS``): ``tasks``
    are evaluated beside the model's perplexity task, which comes first (one of them where they name one)."""
    context = getattr(target.config, "max_position_embeddings", None) or 512
    window = min(512, int(context))
    seq = min(128, window)
    if target.task is not None and is_backcopy(target.task):
        data = {"data": target.task, "seq_len": 128, "batch_size": 8}
        default, calibration, observe = "quantgate_backcopy", {**data, "batches": 8}, {**data, "batches": 3}
    else:
        default = "quantgate_mlm_ppl" if target.family.objective == "mlm" else "quantgate_ppl"
        calibration = {"data": "train", "batches": 4, "seq_len": seq, "batch_size": 8}
        observe = {"data": "validation", "batches": 3, "seq_len": seq, "batch_size": 4}
    given = list(dict.fromkeys(tasks or []))
    headline = next((task for task, _ in PPL_KEYS if task in given), default)
    chosen = [headline, *(t for t in given if t != headline)]
    return Settings(chosen, window if "quantgate_ppl" in chosen else None, calibration, observe)


@dataclass
class Costs:
    """Measured here: seconds to load the model, seconds per token of a forward pass, tokens per document; then
    the seconds each rung's step took (the estimate of the next rungs)."""

    load_s: float
    per_token_s: float
    doc_tokens: list[int]
    rungs_s: list[float] = field(default_factory=list)
    overhead_s: float = 2.0  # one study run's fixed work besides loading: lm-eval's set-up, the report

    tasks: int = 1  # tasks evaluated; each is counted as costing what the perplexity task costs
    widths: frozenset[int] = frozenset()  # the input widths of the model's Linears (what a group size must divide)

    def eval_s(self, docs: int) -> float:
        return self.tasks * (1.15 * self.per_token_s * sum(self.doc_tokens[:docs]) + self.overhead_s)

    def rung_s(self, docs: int, settings: Settings) -> float:
        """A rung: loading the model, calibrating, the quantized evaluation; the median measured, once one is (a
        slow one, FP8's simulation, does not make every later rung look as slow)."""
        if self.rungs_s:
            return statistics.median(self.rungs_s) + self.load_s + self.overhead_s
        calibrate = self.per_token_s * settings.tokens("calibration")
        return FIRST_RATIO * (self.eval_s(docs) + calibrate) + self.load_s + self.overhead_s

    def base_s(self, docs: int, settings: Settings) -> float:
        """The model, its observation and its float evaluation."""
        return self.load_s + 3 * self.per_token_s * settings.tokens("observe") + self.eval_s(docs)


def _doc_tokens(settings: Settings, tok) -> list[int]:
    """Tokens each unit of the evaluation's limit costs, in the task's order (its first ``MAX_DOCS``)."""
    task = settings.tasks[0]
    if task in BATCH_TASKS:
        return [BATCH_TOKENS] * MAX_DOCS[task]
    if task == "quantgate_ppl":
        docs = list(in_turn(corpus("test")))[: MAX_DOCS[task]]
        return [len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in docs]
    return [512] * 50  # an lm-eval task: items of a few hundred tokens, a few choices each


def _measure(target: Target, settings: Settings, dtype: str, placement: Placement | None) -> Costs:
    """Load the model and time its forward pass on one window (after a warm-up): this machine's throughput."""
    start = time.perf_counter()
    model = load(target.load, target.variant, dtype=DTYPES[dtype] if dtype != "float32" else None, placement=placement)
    if placement is None and torch.cuda.is_available():  # where the study's cells run it
        model = model.to("cuda")
    load_s = time.perf_counter() - start
    tok = get_tokenizer(model)
    length = settings.max_length or 128
    device = next(model.parameters()).device
    vocab = min(len(tok), int(getattr(model.config, "vocab_size", len(tok))))
    ids = torch.randint(5, vocab - 1, (1, length), device=device)
    times = []
    with torch.inference_mode():
        for _ in range(5):  # the first warms up; the fastest of the others, as other work on the machine only slows
            t0 = time.perf_counter()
            model(input_ids=ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    per_token = min(times[1:]) / length
    widths = frozenset(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    return Costs(load_s, per_token, _doc_tokens(settings, tok), tasks=len(settings.tasks), widths=widths)


@dataclass(frozen=True)
class Plan:
    """How the audit spends its budget: the documents, the ladder it may climb and the estimates."""

    docs: int
    estimate_s: float
    cut: str  # what the budget cut, in words ("" where nothing)


def _batched(settings: list[Settings]) -> bool:
    """Whether the evaluation's limit counts batches of 16 sequences (every model reads a computed task)."""
    return all(s.tasks[0] in BATCH_TASKS for s in settings)


def _limit_units(n: int, settings: list[Settings]) -> str:
    """``n`` units of the evaluation's limit in words: documents, or batches of 16 sequences."""
    if _batched(settings):
        return f"{n} batch{'es' * (n != 1)} of 16 sequences"
    return f"{n} document{'s' * (n != 1)}"


def _min_docs(settings: list[Settings]) -> int:
    """The fewest units of the limit that give a verdict: :data:`MIN_DOCS` documents (or lm-eval items), or one
    batch of 16 sequences of a computed task (each sequence its own cluster)."""
    return 1 if _batched(settings) else MIN_DOCS


def _plan(costs: list[Costs], settings: list[Settings], ladder: list[Rung], budget_s: float, spent: float,
          docs: int | None = None) -> Plan:  # fmt: skip
    """The most documents (up to the task's maximum; ``docs`` where given) with which the float evaluations and
    every climbing rung fit the budget; refuses a budget in which not even the first rung fits at the fewest that
    give a verdict (:func:`_min_docs`)."""
    climb = [r for r in ladder if not r.probe]
    most = min(len(c.doc_tokens) for c in costs)

    def total(docs: int, rungs: int) -> float:
        return spent + sum(c.base_s(docs, s) + rungs * c.rung_s(docs, s) for c, s in zip(costs, settings, strict=True))

    least = min(docs or _min_docs(settings), most)
    if total(least, 1) > budget_s * SAFETY:
        need = total(least, 1) / SAFETY
        raise AuditError(
            f"a budget of {_duration(budget_s)} is too small for any interval on this machine: the float evaluation "
            f"and one scheme on {_limit_units(least, settings)} take about {_duration(need)} here; give --budget "
            f"{_duration(need, up=True)} or more"
        )
    if docs is None:
        docs = max((n for n in range(least, most + 1) if total(n, len(climb)) <= budget_s * SAFETY), default=least)
    cut = f"{docs} of the {most} documents the main job reads" if docs < most else ""
    return Plan(docs, total(docs, len(climb)), cut)


def _duration(seconds: float, up: bool = False) -> str:
    """``90s``, ``4m`` (rounded up to a whole minute with ``up`` above two minutes)."""
    if seconds < 120:
        return f"{int(seconds + 0.999) if up else round(seconds)}s"
    minutes = seconds / 60
    return f"{int(minutes + 0.999) if up else round(minutes)}m"


# --- the generated study -----------------------------------------------------------------------------


def _study(targets: list[Target], settings: list[Settings], dtype: str, docs: int, schemes: list[str],
           within: float, placement: Placement | None, pairs: list[list[str]]) -> dict:  # fmt: skip
    """The study file the audit writes (DIR/audit.yaml), with the schemes climbed so far."""
    models = []
    for t, s in zip(targets, settings, strict=True):
        m: dict[str, Any] = {"name": t.name, "load": t.load}
        if dtype != "float32":
            m["dtype"] = dtype
        if t.variant is not None:
            m["variants"] = [t.variant]
        ev: dict[str, Any] = {"tasks": s.tasks, "limit": dict.fromkeys(s.tasks, docs), "batch_size": s.batch_size}
        if s.max_length is not None:
            ev["max_length"] = s.max_length
        m.update(eval=ev, observe=s.observe, calibration=s.calibration)
        if placement is not None:
            m["placement"] = {k: v for k, v in dataclasses.asdict(placement).items() if v is not None}
        models.append(m)
    report: dict[str, Any] = {"fixes": {"reference": REFERENCE, "within": within}}
    if pairs:
        report["pairs"] = pairs
    names = ", ".join(t.name for t in targets)
    return {
        "name": folder_name(f"audit-{targets[-1].name}", "audit name"),
        "description": (
            f"Generated by quantgate audit: {names} observed, then a ladder of schemes (cheapest at run time "
            f"first) each against float on the same {docs} documents, until one is within +{within:.2%}."
        ),
        "out": ".",
        "seed": 0,
        "models": models,
        "schemes": schemes,
        "report": report,
    }


# --- the answer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Audit:
    """What an audit found. ``answer``: audit.md's text, the answer first; ``survives_static_int8``: None where
    that is not resolved; ``recipe``: the cheapest scheme within the tolerance on the audited model (None: none
    was); ``export``: the folder holding a recipe within the tolerance (None: not written), ``export_note``: its
    format and which recipe, or why there is none; ``changes``: {model: {scheme: perplexity change}}."""

    out: Path
    answer: str
    survives_static_int8: bool | None
    recipe: str | None
    export: Path | None
    export_note: str
    changes: dict[str, dict[str, Delta]] = field(default_factory=dict)


def _why(cell: CellRecord) -> str:
    """The outlier profile of a cell, in one sentence: what a per-tensor INT8 scale has to cover."""
    peak, ratio = peak_activation(cell)
    parts = [f"largest residual activation {peak:.4g}, {ratio:.4g}x its block's median |x|" if ratio else ""]
    top = cell.summary.top_massive[:1]
    if top:
        t = top[0]
        where = ", ".join(str(p[0]) for p in t.positions[:3])
        parts.append(f"the largest in channel {t.channel} of block {t.layer}, at token position(s) {where}")
    try:
        sink, layer = max_layer_sink(cell)
        parts.append(f"first-token attention up to {sink:.2f} (layer {layer})")
    except ValueError:  # no layer with attention statistics
        pass
    if cell.summary.gate_mean is not None:
        parts.append(f"mean gate {cell.summary.gate_mean:.3g}")
    return "; ".join(p for p in parts if p)


WORDS = {"fixed": "within", "not resolved": "not resolved", "not fixed": "not within", "not run": "not run"}


def _met(cell: CellRecord, run: list[Rung], within: float, low: bool) -> list[Rung]:
    """The rungs whose whole interval on ``cell`` lies below ``within``, in ladder order."""
    return [r for r in run if verdict(ppl_change(cell, r.scheme), within, low_precision=low) == "fixed"]


def _unresolved(d: Delta, within: float, low: bool) -> str:
    """Why a change decides nothing at ``within``: an approximate interval, a bfloat16 reading too near the
    threshold, or an interval that straddles it."""
    if d.approximate:
        return (
            f"its interval is approximate ({d.n} documents from {d.clusters} independent works or sequences; "
            f"{MIN_CLUSTERS} give a verdict: --docs {MIN_CLUSTERS} or a larger --budget)"
        )
    if d.low is None or d.high is None:
        return "it has no interval"
    if low and not d.low < within <= d.high:
        return "read in bfloat16 closer to the threshold than bfloat16's tolerance: audit with --dtype float32"
    return f"its interval straddles +{within:.2%}"


def _answer(cells: dict[str, CellRecord], run: list[Rung], within: float, low: bool, focus: str, cut: list[Rung],
            note: str, pairs: list[list[str]]) -> tuple[list[str], bool | None, str | None]:  # fmt: skip
    """audit.md's opening lines, whether ``focus`` survives static INT8 (None: not run, or not resolved) and its
    recipe; ``low``: read in bfloat16 or float16 (:func:`~quantgate.study.fixes.verdict`)."""
    lines = []
    cell = cells[focus]
    static = ppl_change(cell, REFERENCE)
    said = verdict(static, within, low_precision=low)
    survives = {"fixed": True, "not fixed": False}.get(said)
    head = f"- **Per-tensor static INT8**: {focus}"
    tolerance = f"the tolerance is +{within:.2%}"
    interval = f"perplexity {format_delta(static)} (95% interval, paired over documents; {tolerance})"
    if said == "not run":
        lines.append(f"{head}: not evaluated.")
    elif said == "not resolved":
        assert static is not None  # "not run" otherwise
        lines.append(f"{head}: not resolved: {interval}; {_unresolved(static, within, low)}.")
    else:
        lines.append(f"{head} {'survives' if survives else 'does not survive'} it: {interval}.")
    met = _met(cell, run, within, low)
    recipe = met[0].scheme if met else None
    climbed = [r for r in run if not r.probe]
    if recipe is not None:
        rung = met[0]
        lines.append(
            f"- **Cheapest recipe within +{within:.2%}**: `{recipe}` ({rung.bits}; {rung.work}): "
            f"{format_delta(ppl_change(cell, recipe))}."
        )
        fewer = [r for r in met if r.probe]
        if fewer:
            lines.append(f"- **With fewer weight bits**: `{fewer[0].scheme}` is within too ({fewer[0].bits}).")
    else:
        changes = {r.scheme: d for r in climbed if (d := ppl_change(cell, r.scheme)) is not None}
        best = min(changes, key=lambda s: changes[s].value, default=None)
        tail = f"; the least change: `{best}` {format_delta(changes[best])}" if best else ""
        lines.append(f"- **Cheapest recipe within +{within:.2%}**: none of the {len(climbed)} rungs run{tail}.")
        unresolved = [s for s, d in changes.items() if verdict(d, within, low_precision=low) == "not resolved"]
        if unresolved:
            more = "; a larger --budget reads more documents" if note else ""
            lines.append(
                "- **Not resolved**: "
                + "; ".join(f"`{s}`: {_unresolved(changes[s], within, low)}" for s in unresolved)
                + f"{more}."
            )
    if survives is not None:
        reason, massive = _why(cell), cell.summary.massive_activations > 0
        if survives:
            lines.append(f"- **Why**: its outliers are small enough for one scale per tensor ({reason}).")
        elif massive:
            lines.append(
                f"- **Why**: one INT8 scale per tensor must cover its outliers, which leaves few of the 255 steps "
                f"for ordinary values ({reason})."
            )
        else:
            lines.append(f"- **Its outlier profile**: no massive activations ({reason}).")
    for ungated, gated in pairs:
        if ungated in cells and gated in cells:
            for r in run:
                gap = change_gap(cells[ungated], cells[gated], r.scheme)
                if gap is not None:
                    lines.append(
                        f"- **The gate's effect** under `{r.scheme}`: {gated}'s change minus {ungated}'s, paired over "
                        f"the same documents, is {format_delta(gap)}: {gap_reading(gap, 'the gated twin')}."
                    )
    if cut:
        lines.append(f"- **Cut by the budget**: {', '.join(f'`{r.scheme}`' for r in cut)}.")
    if note:
        lines.append(f"- **Sized to the budget**: {note}.")
    return lines, survives, recipe


def _units(cell: CellRecord) -> str:
    """What the changes were paired over: ``24 documents`` of text, ``128 sequences`` of a synthetic task."""
    change = ppl_change(cell, REFERENCE)
    n = change.n if change is not None else 0
    return f"{n} documents" if "quantgate_ppl" in cell.float_documents else f"{n} sequences"


def _table(cells: dict[str, CellRecord], run: list[Rung], within: float, low: bool) -> list[str]:
    """One row per rung run: its bits, run-time work, each model's change, the verdict and the step's seconds here
    (quantizing, calibration included, and evaluating; a simulated scheme's time is not its deployed speed)."""
    names = list(cells)
    head = ["rung", "bits", "run-time work", *(f"{n} change [95% CI]" for n in names), "verdict", "step s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in run:
        deltas = [ppl_change(cells[n], r.scheme) for n in names]
        word = " / ".join(WORDS[verdict(d, within, low_precision=low)] for d in deltas)
        label = f"`{r.scheme}`" + (" (probe)" if r.probe else "")
        seconds = "+".join(f"{cells[n].scheme(r.scheme).seconds:.0f}" for n in names)
        lines.append("| " + " | ".join([label, r.bits, r.work, *map(format_delta, deltas), word, seconds]) + " |")
    return lines


# --- the export ------------------------------------------------------------------------------------


LOADERS = {"clm": "AutoModelForCausalLM", "mlm": "AutoModelForMaskedLM"}


def _export(target: Target, settings: Settings, dtype: str, recipes: list[str], out: Path,
            placement: Placement | None) -> tuple[Path, str, str, str]:  # fmt: skip
    """The first of ``recipes`` that another tool's format holds (else the first, in quantgate's own format),
    quantized as the study quantized it and saved to ``out``: ``(out, the recipe written, its format, why not
    another's)``. A gated model's format is quantgate's whatever the recipe, so only the first is quantized."""
    reasons: list[str] = []
    first = None  # the first recipe quantized: saved in quantgate's own format where no recipe fits another's
    for recipe in recipes[:1] if target.variant is not None else recipes:
        q, tok = _quantized(target, settings, dtype, recipe, placement)
        kind, why = export_format(q, get_scheme(recipe))
        if kind != "quantgate":
            claim_output(out, "model", "the audit's export", overwrite=True)
            save(q, out, tok)
            return out, recipe, kind, "; ".join(reasons)
        reasons.append(f"`{recipe}`: {why}")
        first = first or (q, tok)
    assert first is not None  # recipes is not empty
    claim_output(out, "model", "the audit's export", overwrite=True)
    save(first[0], out, first[1])
    return out, recipes[0], "quantgate", "; ".join(reasons)


def _quantized(target: Target, settings: Settings, dtype: str, recipe: str, placement: Placement | None):
    """The target loaded as the study loads it (on the GPU where there is one), quantized with ``recipe`` as the
    study's cell quantized it (:func:`~quantgate.study.steps.quantize_calibrated`, seed 0), and its tokenizer."""
    model = load(target.load, target.variant, dtype=DTYPES[dtype] if dtype != "float32" else None,
                 placement=placement)  # fmt: skip
    if placement is None and torch.cuda.is_available():
        model = model.to("cuda")
    tok = get_tokenizer(model)
    calibration = DataSettings(**settings.calibration)
    return quantize_calibrated(model, tok, recipe, calibration, 0, inplace=placement is not None), tok


def _load_lines(target: Target, export: Path, others: bool) -> list[str]:
    """How to load the export: quantgate, and where ``others`` read its format, transformers and vLLM."""
    loader = LOADERS[target.family.objective]
    lines = [f'- quantgate: `import quantgate as qg; qg.load("{export}")`']
    if not others:
        return lines
    lines.append(f'- transformers: `from transformers import {loader}; {loader}.from_pretrained("{export}")`')
    if target.family.objective == "clm":
        lines.append(f"- vLLM (on a GPU; see docs/guides/serve-with-vllm.md for the CPU): `vllm serve {export}`")
    return lines


# --- the audit -------------------------------------------------------------------------------------


@contextmanager
def _progress(total_s: float, enabled: bool) -> Iterator[tqdm]:
    """One bar for the whole audit, in estimated seconds, ticking with the clock (ETA: the estimate left)."""
    total = max(round(total_s), 1)
    bar = tqdm(total=total, unit="s", desc="audit", disable=None if enabled else True, leave=True)
    start, stop = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.n = min(round(time.perf_counter() - start), total - 1)
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.n = total
        bar.close()


def _runnable(ladder: list[Rung], costs: list[Costs]) -> list[Rung]:
    """The default ladder's rungs every audited model can run (a weight group size that divides each Linear's input
    width: SmolLM2's 576 is no multiple of INT4's groups of 128); one left out is logged with why."""
    widths = frozenset().union(*(c.widths for c in costs))
    kept = []
    for rung in ladder:
        why = get_scheme(rung.scheme).unfit(widths)
        if why:
            log.info("audit: %s left out: %s", rung.scheme, why)
        else:
            kept.append(rung)
    return kept


def _ladder(schemes: list[str] | None) -> list[Rung]:
    """The default ladder (with torchao's real kernels where a GPU and torchao are here), or the schemes given."""
    if schemes:
        known = {r.scheme: r for r in (*LADDER, *GPU_RUNGS)}
        names = list(dict.fromkeys(str(get_scheme(s)) for s in schemes))  # an unknown one fails, naming the registry
        if REFERENCE not in names:
            names.insert(0, REFERENCE)
        # the schemes given are climbed in their order (none is a probe), the question first
        names.sort(key=lambda name: name != REFERENCE)
        return [
            dataclasses.replace(known[n], probe=False) if n in known else Rung(n, "-", get_scheme(n).range_kind())
            for n in names
        ]
    rungs = list(LADDER)
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("torchao") is not None:
        at = next(i for i, r in enumerate(rungs) if r.scheme == "w8a8-int8-dynamic") + 1
        rungs[at:at] = GPU_RUNGS
    return rungs


def audit(
    model: str,
    out: str | Path | None = None,
    *,
    budget: str | float = "10m",
    within: str | float = 0.01,
    tasks: list[str] | None = None,
    variant: str | None = None,
    dtype: str | None = None,
    placement: Placement | None = None,
    schemes: list[str] | None = None,
    docs: int | None = None,
    export: bool = True,
    progress: bool = True,
) -> Audit:
    """Audit ``model`` (a folder saved by transformers or quantgate, a packaged name, a cached hub id) for INT8/FP8
    within ``budget`` (seconds or ``10m``) and tolerance ``within`` (a fraction, or ``1%``); writes ``out``
    (default ``audits/<name>``): audit.md, audit.yaml, the study's report and the export (module docstring).
    ``schemes``: climb these instead of :data:`LADDER`; ``docs``: read this many documents (default: as many as
    the budget allows, up to the main job's number)."""
    started = time.perf_counter()
    budget_s, tolerance = parse_budget(budget), parse_within(within)
    target, targets, pairs = _targets(model, variant, docs, tasks)
    dtype = _dtype_of(target, dtype)
    low = dtype in LOW_PRECISION_DTYPES  # a verdict nearer its threshold than bf16's tolerance: not resolved
    for t in targets:
        _check_memory(t, dtype, placement)
    settings = [_settings(t, tasks) for t in targets]
    out = Path(out) if out is not None else Path("audits") / target.name
    out = claim_output(out, "study", "--out", mark=True, by="quantgate audit", inputs=[target.folder])
    ladder = _ladder(schemes)
    plan_file = out / "audit.json"
    asked = {"model": str(model), "budget_s": budget_s, "within": tolerance, "tasks": tasks, "dtype": dtype,
             "variant": variant, "ladder": [r.scheme for r in ladder], "docs": docs}  # fmt: skip
    costs = [_measure(t, s, dtype, placement) for t, s in zip(targets, settings, strict=True)]
    ladder = ladder if schemes else _runnable(ladder, costs)  # schemes given by name: their study refuses them
    spent = time.perf_counter() - started
    plan = _sized(plan_file, asked, costs, settings, ladder, budget_s, spent, docs, targets)
    c0, s0 = costs[targets.index(target)], settings[targets.index(target)]
    reserve = c0.load_s + FIRST_RATIO * c0.per_token_s * s0.tokens("calibration") + c0.overhead_s if export else 0.0
    study_file = out / "audit.yaml"
    question = _Question(targets, settings, dtype, tolerance, placement, pairs, out, asked)
    with _progress(plan.estimate_s - spent, progress) as bar:
        run, cut, cells = _climb(
            question, ladder, plan, costs, budget_s - reserve - (time.perf_counter() - started), bar
        )
    focus = target.name
    opening, survives, recipe = _answer(cells, run, tolerance, low, focus, cut, plan.cut, pairs)
    met = [r.scheme for r in _met(cells[focus], run, tolerance, low)]
    export_dir, note, export_lines = (
        _exported(target, settings[targets.index(target)], dtype, met, out / "export", placement)
        if export and met
        else (None, "not asked for (--no-export)" if not export else "no scheme was within the tolerance", [])
    )
    if export_dir is None:
        export_lines = [f"No export: {note}. Export a scheme of the ladder yourself with `quantgate quantize`."]
    lines = [f"# Audit of {focus}", "", *opening, "", *export_lines, "", "## The ladder", ""]
    lines += [*_table(cells, run, tolerance, low), ""]
    lines.append(
        f"Each change is the perplexity under the scheme over the float perplexity on the same "
        f"{_units(cells[focus])}, with a 95% interval paired over them; *within* means the whole interval lies below "
        f"+{tolerance:.2%}. The study behind it is `{study_file}` (rerun it: `quantgate study {study_file}`); "
        f"its report: `{out / 'report.md'}`. Audit time: {time.perf_counter() - started:.0f} s of a "
        f"{_duration(budget_s)} budget."
    )
    text = "\n".join(lines) + "\n"
    write_text_atomic(out / "audit.md", text)
    changes = {
        name: {r.scheme: d for r in run if (d := ppl_change(c, r.scheme)) is not None} for name, c in cells.items()
    }
    return Audit(out, text, survives, recipe, export_dir, note, changes)


@dataclass(frozen=True)
class _Question:
    """What an audit's study runs: its models and their settings, the dtype, the tolerance (a fraction), where
    the models go, the pairs of twins, the audit's folder and the question as audit.json records it."""

    targets: list[Target]
    settings: list[Settings]
    dtype: str
    tolerance: float
    placement: Placement | None
    pairs: list[list[str]]
    out: Path
    asked: dict


def _climb(
    q: _Question, ladder: list[Rung], plan: Plan, costs: list[Costs], left_s: float, bar: Any
) -> tuple[list[Rung], list[Rung], dict[str, CellRecord]]:
    """Run the ladder's rungs in order, each a study of the rungs so far, until one is within the tolerance;
    then only the probes. A rung that would not finish in the ``left_s`` seconds left is cut. Returns (the rungs
    run, those cut, the study's cells)."""
    started = time.perf_counter()
    low = q.dtype in LOW_PRECISION_DTYPES  # a verdict nearer its threshold than bf16's tolerance: not resolved
    run: list[Rung] = []
    cut: list[Rung] = []
    cells: dict[str, CellRecord] = {}
    found = False
    for rung in ladder:
        if rung.probe != found:  # climbing until a rung is within; then only the probes
            continue
        estimate = sum(c.rung_s(plan.docs, s) for c, s in zip(costs, q.settings, strict=True))
        if run and time.perf_counter() - started + estimate > left_s:
            cut.append(rung)
            continue
        bar.set_description(f"audit: {rung.scheme}")
        run.append(rung)
        schemes = [r.scheme for r in run]
        spec = _study(q.targets, q.settings, q.dtype, plan.docs, schemes, q.tolerance, q.placement, q.pairs)
        write_text_atomic(q.out / "audit.yaml", yaml_text(spec))
        record = {"asked": q.asked, "docs": plan.docs, "estimate_s": plan.estimate_s, "cut": plan.cut}
        write_text_atomic(q.out / "audit.json", json.dumps({**record, "per_token_s": [c.per_token_s for c in costs]}))
        run_study(q.out / "audit.yaml", q.out)
        cells = {c.model: c for c in read_metrics(q.out).cells}
        _learn(costs, q.targets, cells, rung.scheme)
        deltas = [ppl_change(cells[t.name], rung.scheme) for t in q.targets]
        if not rung.probe and all(verdict(d, q.tolerance, low_precision=low) == "fixed" for d in deltas):
            found = True
    return run, cut, cells


def _sized(
    plan_file: Path,
    asked: dict,
    costs: list[Costs],
    settings: list[Settings],
    ladder: list[Rung],
    budget_s: float,
    spent: float,
    docs: int | None,
    targets: list[Target],
) -> Plan:
    """The audit's plan: the one ``plan_file`` holds where it answers the same question (the same documents, so
    the steps are reused), else one sized to the budget by the measured ``costs``."""
    previous = read_json(plan_file) if plan_file.is_file() else {}
    if previous.get("asked") == asked:  # the same audit again: the same documents, so its steps are reused
        plan = Plan(int(previous["docs"]), previous.get("estimate_s", budget_s), previous.get("cut", ""))
    else:
        plan = _plan(costs, settings, ladder, budget_s, spent, docs)
    per_rung = sum(c.rung_s(plan.docs, s) for c, s in zip(costs, settings, strict=True))
    log.info(
        "audit of %s: %d documents, a forward pass %.2f ms per token here, about %.0f s a rung; %s budget",
        ", ".join(t.name for t in targets),
        plan.docs,
        1000 * costs[-1].per_token_s,
        per_rung,
        _duration(budget_s),
    )
    return plan


def _targets(
    model: str, variant: str | None, docs: int | None, tasks: list[str] | None
) -> tuple[Target, list[Target], list[list[str]]]:
    """The model audited, the models the study runs (with a packaged twin, the pair: ungated first) and the
    pairs of twins; refuses a number of documents below 2 and unknown tasks first."""
    if docs is not None and (isinstance(docs, bool) or not isinstance(docs, int) or docs < 2):
        raise AuditError(f"--docs {docs!r}: a paired interval needs at least 2 documents")
    unknown = unknown_tasks(tasks or [])
    if unknown:
        bundled = ", ".join(BUNDLED_TASKS)
        raise AuditError(f"--tasks: unknown task(s) {', '.join(unknown)}; bundled (offline): {bundled}")
    target = _target(model, variant)
    twin = PACKAGED[target.load].twin if target.load in PACKAGED else None
    if twin is None:
        return target, [target], []
    other = _target(twin, None)  # a packaged twin: the pair, so that the gate's effect is measured
    targets = sorted([target, other], key=lambda t: _target(t.load, None).variant is not None)  # ungated first
    return target, targets, [[targets[0].name, targets[1].name]]


def _exported(
    target: Target, settings: Settings, dtype: str, met: list[str], folder: Path, placement: Placement | None
) -> tuple[Path, str, list[str]]:
    """Export the first scheme of ``met`` to ``folder``: (the folder, the format in words, the page's lines
    saying where it is and how to load it)."""
    export_dir, written, kind, why = _export(target, settings, dtype, met, folder, placement)
    if kind == "quantgate":
        note = f"quantgate's own format, which transformers and vLLM refuse: {why}"
    else:
        note = f"{kind} format" + (f" (not {why})" if why else "")
    lines = [f"`{written}` is written to `{export_dir}` in {note}. Load it with:", ""]
    return export_dir, note, lines + _load_lines(target, export_dir, kind != "quantgate")


def _learn(costs: list[Costs], targets: list[Target], cells: dict[str, CellRecord], scheme: str) -> None:
    """Record the seconds the rung just run took on each model (its step), for the next estimates."""
    for c, t in zip(costs, targets, strict=True):
        seconds = cells[t.name].scheme(scheme).seconds
        if seconds:
            c.rungs_s.append(seconds)
