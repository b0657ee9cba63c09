"""Command line: ``quantgate <command>``. Each command is a thin wrapper over the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .audit import audit
from .data import batches
from .data.corpus import BUNDLED_SPLITS, DATASETS
from .data.tokenizers import BUNDLED_TOKENIZERS, TOKENIZER_DIR, build_bundled
from .errors import InputError, MissingFile, QuantgateError
from .eval.checks import NonFiniteOutputs, check_limit, check_limit_per_process, check_lm_eval_options
from .eval.evaluate import Evaluation, LmEvalOutput, evaluate, require_lm_eval
from .eval.load import load_for_eval
from .files import claim_output, os_error_line, read_json, refuse_same, writable_dir, write_text_atomic
from .model_files import load, load_or_build, save
from .models import PACKAGED, PRESETS, build, family_of, gate_parameters, tokenizer, variant_of
from .models.cost import parameter_count
from .models.io import DTYPES, Placement
from .models.presets import preset_config
from .models.record import checked_record
from .models.sources import resolve
from .observe import observe
from .options import check_range
from .parallel import is_first, joined, relaunch
from .quant import SCHEMES, get_scheme, quant_error, quantization_of, quantize
from .quant.export import export_format
from .runlock import run_lock
from .stats import CLUSTERS
from .study import DEFAULT_STUDY, plan, read_metrics, run_study
from .study.compare import compare
from .study.executors import EXECUTORS
from .study.report import write_study_report
from .study.schema import SECTION_RULES
from .train import TrainConfig, train
from .variants import AttentionVariant

__all__ = ["main"]


def _placement_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype and accelerate's big-model placement (--device-map, --max-memory, --offload-folder)."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="load the model in this dtype (default: float32); the quantizers' arithmetic stays float32",
    )
    parser.add_argument(
        "--device-map",
        help="shard the model as it loads: auto, balanced, sequential, or JSON {module: device|cpu|disk}",
    )
    parser.add_argument(
        "--max-memory", help="with --device-map: the memory each device may hold, e.g. 0=70GiB,cpu=200GiB"
    )
    parser.add_argument("--offload-folder", help="with --device-map: where weights placed on disk go")


def _placement(args: argparse.Namespace) -> Placement | None:
    """The placement --device-map, --max-memory and --offload-folder ask for (None: the model loads whole)."""
    device_map: str | dict | None = args.device_map
    if args.device_map is not None and args.device_map.lstrip().startswith("{"):
        try:
            device_map = json.loads(args.device_map)
        except json.JSONDecodeError as e:
            raise InputError(f"--device-map {args.device_map!r} is not valid JSON: {e}") from None
    max_memory = None
    if args.max_memory:
        pairs = [item.partition("=") for item in args.max_memory.split(",")]
        if any(not k.strip() or not v.strip() for k, _, v in pairs):
            raise InputError(f"--max-memory {args.max_memory!r}: give DEVICE=SIZE pairs, e.g. 0=70GiB,cpu=200GiB")
        max_memory = {int(k) if k.strip().isdigit() else k.strip(): v.strip() for k, _, v in pairs}
    if device_map is None and max_memory is None and args.offload_folder is None:
        return None
    return Placement(device_map, max_memory, args.offload_folder)


def _load_or_build(source: str, variant: str | None, dtype: str | None = None, placement: Placement | None = None):
    """:func:`~quantgate.model_files.load_or_build` with ``dtype`` by its name in DTYPES."""
    return load_or_build(source, variant, dtype=DTYPES[dtype] if dtype else None, placement=placement)


def _batches(model, tokenizer, source: str, seq_len: int, batch_size: int, **kwargs):
    """Text batches for ``model`` (its objective), refusing a ``seq_len`` its positions cannot hold."""
    family = family_of(model)
    family.check_seq_len(model.config, seq_len)
    return batches(tokenizer, source, seq_len, batch_size, family.objective, **kwargs)


def cmd_info(args: argparse.Namespace) -> int:
    if args.list:
        print("presets (shapes, built from config):")
        for name, p in PRESETS.items():
            print(f"  {name:<16} {p.family:<11} {p.description}")
        print("packaged checkpoints (real weights, offline):")
        for name, packaged in PACKAGED.items():
            print(f"  {name:<16} {packaged.description}")
        print(f"bundled tokenizers: {', '.join(BUNDLED_TOKENIZERS)}")
        print(
            f"text sources: {', '.join(BUNDLED_SPLITS)} (bundled); "
            f"{', '.join(f'{d}:<split>' for d in DATASETS)}, hf:<dataset>[@<config>]:<split> (online)"
        )
        print("variants (combine with '+', parameters as name:key=value,...):")
        for name, text in AttentionVariant.describe().items():
            print(f"  {name:<16} {text}")
        return 0
    if not args.model:
        raise InputError("info needs a preset or a model directory (or --list)")
    model = _load_or_build(args.model, args.variant)
    gates = gate_parameters(model)
    n_gate = parameter_count(gates.values())  # by storage: a tied head (two Parameters over one tensor) once
    n_all = parameter_count(model)
    dtype = next(model.parameters()).dtype
    quant = quantization_of(model)
    rows = [
        ("model", args.model),
        ("family", family_of(model).name),
        ("class", type(model).__name__),
        ("variant", str(variant_of(model))),
        ("parameters", f"{n_all:,} ({n_all - n_gate:,} base + {n_gate:,} gate/sink)"),
        ("dtype", str(dtype).removeprefix("torch.")),
        ("quantization", quant.scheme if quant else "none"),
    ]
    if quant:
        rows.append(("quantized by", quant.origin))
    if quant and quant.source_sha256:
        rows.append(("float source", f"{quant.source_model or '?'} (sha256 {quant.source_sha256[:16]})"))
    rows.append(("layers", str(model.config.num_hidden_layers)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _output(
    out: str | None, *inputs: str | None, what: str = "--out", kind: str | None = None, overwrite: bool = False
) -> None:
    """Check the output directory ``out`` (when given) before the work: writable, not the folder of one of the
    ``inputs`` (model directories; links and .. resolved), whose files the output would overwrite, and, for
    output of ``kind``, a folder quantgate may write into (:func:`~quantgate.files.claim_output`: empty, or its
    own of that kind; a model's only with ``overwrite``; no link out of it)."""
    if out is None:
        return
    for source in inputs:
        if source and Path(source).exists():
            refuse_same(out, resolve(source).resolve(), "the directory of the model it reads")
    if kind is None:
        writable_dir(out, what, create=False)  # a command refused later leaves no folder behind
    else:
        claim_output(out, kind, what, overwrite=overwrite)  # checked only: nothing made or marked yet


def _option(dest: str) -> str:
    """The command line's name of a setting: batch_size -> --batch-size."""
    return "--" + dest.replace("_", "-")


def _check_options(args: argparse.Namespace, section: str, options: dict[str, str]) -> None:
    """Each option in the range a study file's ``section`` allows the same setting (``options``: the option's
    argparse dest -> the section's key): one definition of what the two doors accept."""
    for dest, key in options.items():
        valid = SECTION_RULES[section][key].valid
        assert not isinstance(valid, tuple)  # a study file's rules bound numbers by a Range
        check_range(_option(dest), getattr(args, dest), valid)


def cmd_observe(args: argparse.Namespace) -> int:
    keys = {"seq_len": "seq_len", "batch_size": "batch_size", "max_batches": "batches", "sink_tokens": "sink_tokens"}
    _check_options(args, "observe", keys)
    if args.sink_tokens >= args.seq_len:
        raise InputError(f"--sink-tokens ({args.sink_tokens}) must be fewer than --seq-len ({args.seq_len})")
    _output(args.out, kind="observe")
    model = _load_or_build(args.model, args.variant, args.dtype, _placement(args))
    data = _batches(model, tokenizer(model), args.data, args.seq_len, args.batch_size, max_batches=args.max_batches)
    report = observe(model, data, sink_tokens=args.sink_tokens)
    out = report.save(claim_output(args.out, "observe", mark=True))
    print(report.markdown())
    print(f"wrote {out}/observe.json, observe.md and plots")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.list:
        for name, scheme in SCHEMES.items():
            print(f"{name:<26} {scheme.description}")
        return 0
    if not args.model or not args.scheme:
        raise InputError("quantize needs a model and --scheme (quantgate quantize --list shows the schemes)")
    _check_options(args, "calibration", {"calib": "batches", "seq_len": "seq_len", "batch_size": "batch_size"})
    scheme = get_scheme(args.scheme)
    needs = scheme.needs_calibration or bool(args.out and scheme.export_calibration)
    if args.calib is not None and not needs:
        unless = " unless it is saved (--out)" if scheme.export_calibration else ""
        raise InputError(f"--calib {args.calib} does nothing here: {scheme} calibrates nothing{unless}; leave it out")
    _output(args.out, args.model, kind="model", overwrite=args.overwrite)  # before the model loads and calibrates
    model = _load_or_build(args.model, args.variant, args.dtype, _placement(args))
    tok = tokenizer(model)
    held_out = _batches(model, tok, "validation", args.seq_len, args.batch_size)
    calib = _batches(model, tok, args.calib_data, args.seq_len, args.batch_size) if needs else None
    calib_option = {"calib": args.calib} if args.calib is not None else {}
    q = quantize(model, scheme, calibration=calib, inplace=args.inplace, **calib_option)
    if args.inplace:  # the float model is gone: nothing to measure the error against
        print(f"{scheme}: quantized in place (no SQNR without the float model: leave out --inplace for it)")
    else:
        report = quant_error(model, q, held_out, max_batches=2)
        print(
            f"{scheme}: logits SQNR {report.logits_sqnr_db:.1f} dB on held-out text; worst blocks: "
            + ", ".join(f"{r.layer} ({r.sqnr_db:.1f} dB)" for r in report.worst_layers)
        )
        if report.overflow:
            print(f"FP8 saturation: {report.overflow} values hit the format's limit")
    if args.out:
        save(q, args.out, tok, dtype=getattr(torch, args.save_dtype) if args.save_dtype else None)
        fmt, _ = export_format(q, scheme)  # the format save wrote
        config = Path(args.out) / "config.json"  # as written: loading moves the real model type back
        why = checked_record(read_json(config), config, "save the model again").load_with
        print(f"wrote {args.out} ({fmt} format: " + (why or "transformers, lm-eval and vLLM load it") + ")")
    return 0


def _evaluate(args: argparse.Namespace, model, model_args: dict) -> Evaluation:
    """``quantgate eval``'s call of :func:`evaluate` with its options."""
    return evaluate(
        model,
        tokenizer(model),
        [t.strip() for t in args.tasks.split(",") if t.strip()],
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=args.bootstrap_iters,
        output_path=args.output_path,
        log_samples=args.log_samples,
        model_args={k: v for k, v in model_args.items() if v is not None},
    )


def cmd_eval(args: argparse.Namespace) -> int:
    limit = check_limit(args.limit)  # before the model loads and calibrates
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    check_limit_per_process(limit, args.processes, tasks)  # before the processes start
    _placement(args)  # its syntax, before the processes start
    _check_options(args, "eval", {"batch_size": "batch_size"})
    check_lm_eval_options(args.num_fewshot, args.bootstrap_iters, args.output_path, args.log_samples)
    _output(args.out, kind="eval")
    if args.output_path:  # a directory, or a results file name ending in .json
        lm_out = Path(args.output_path)
        _output(str(lm_out.parent if lm_out.suffix == ".json" else lm_out), what="--output-path")
    return _in_processes(args, _eval)


def _in_processes(args: argparse.Namespace, run: Callable[[argparse.Namespace, Any], int]) -> int:
    """``run(args, state)`` in each of ``--processes`` N processes (``state``: accelerate's Accelerator of the
    run, None in a lone process); started here, or by a launcher (torchrun, accelerate launch) already."""
    if args.processes < 1:
        raise InputError(f"--processes must be a whole number >= 1, got {args.processes}")
    state = joined()  # one of N processes a launcher started (--processes N, torchrun, accelerate launch)
    if state is None and args.processes > 1:
        return relaunch(args.argv, args.processes)  # each of them runs this command, and joins here
    try:
        return run(args, state)
    finally:
        if state is not None:
            state.end_training()  # leaves the process group


def _eval(args: argparse.Namespace, state) -> int:
    dtype = DTYPES[args.dtype] if args.dtype else None
    device = state.device if state is not None and state.device.type == "cuda" else None  # a GPU per rank
    placement = _placement(args)
    model = load_for_eval(args.model, args.variant, args.scheme, dtype=dtype, device=device, placement=placement)
    model_args = {"pretrained": args.model, "scheme": args.scheme, "variant": args.variant, "dtype": args.dtype}
    try:
        result = _evaluate(args, model, model_args)
    except NonFiniteOutputs as e:  # keep the tasks that finished before the one that failed
        if args.out and e.partial.get("results") and is_first():
            claim_output(args.out, "eval", mark=True)
            write_text_atomic(Path(args.out) / "eval.partial.json", json.dumps(e.partial, indent=1))
            raise InputError(f"{e} (the tasks finished before it: {Path(args.out) / 'eval.partial.json'})") from None
        raise
    if not is_first():  # every rank holds rank 0's result; rank 0 reports and writes it
        return 0
    for task, metrics in result.results.items():
        shown = [
            f"{k} {v:.4g}" + (f" ± {metrics[k + '_stderr']:.2g}" if k + "_stderr" in metrics else "")
            for k, v in metrics.items()
            if k != "sample_len" and not k.endswith("_stderr")
        ]
        print(f"{task}: " + ", ".join(shown))
    if args.out:
        out = claim_output(args.out, "eval", mark=True)
        write_text_atomic(out / "eval.json", json.dumps(result.to_json(), indent=1))
        print(f"wrote {out / 'eval.json'}")
    for path in _lm_eval_files(result.lm_eval_output):
        print(f"wrote {path}")
    return 0


def _lm_eval_files(written: LmEvalOutput | None) -> list[str]:
    """The files evaluate() wrote in lm-eval's format: its results, then each task's samples."""
    return [written.results, *(written.samples or {}).values()] if written else []


def cmd_lm_eval(args: argparse.Namespace) -> int:
    require_lm_eval()  # one line naming what to install, before lm-eval's own import errors
    from .eval.lm_eval_models import main as lm_eval_main  # lm-eval is optional: imported at first use

    return lm_eval_main(args.args)


def cmd_compare(args: argparse.Namespace) -> int:
    print(compare(args.runs, args.out, baseline=args.baseline, force_baseline=args.force_baseline))
    if args.out:
        print(f"wrote {args.out}/compare.md, compare.csv, compare.png")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if bool(args.preset) == bool(args.model):
        raise InputError("train needs exactly one of --preset (from scratch) or --model (a checkpoint to fine-tune)")
    overrides = _config_overrides(args.config)
    if overrides and not args.preset:
        raise InputError("--config changes a preset's shape; it does not apply to --model checkpoints")
    fields = {
        k: getattr(args, k)
        for k in (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "lr",
            "warmup",
            "data",
            "eval_every",
            "observe_every",
            "checkpoint_every",
            "seed",
            "out",
            "resume",
            "overwrite",
            "stop_after",
            "schedule",
            "log_with",
        )
        if getattr(args, k) is not None
    }
    config = TrainConfig(**fields).check(_option)  # the ranges a study's train: has, before the model builds
    if args.preset:
        preset_config(args.preset, overrides)  # the check a study's config: has, before anything is written
    _output(args.out, kind="train")  # before the model builds and trains (--overwrite: train's own rule, later)
    model = (
        build(args.preset, args.variant, seed=args.seed, **overrides) if args.preset else load(args.model, args.variant)
    )
    if args.objective and args.objective != _objective(model):
        raise InputError(
            f"{args.preset or args.model} is a {_objective(model)} model; --objective {args.objective} does not fit it"
        )
    train(model, tokenizer(model), config=config)
    if args.out and config.stop_after is not None and config.stop_after < config.steps:
        print(
            f"stopped at step {config.stop_after}: wrote {args.out}/checkpoints/step-{config.stop_after} and "
            f"log.jsonl; continue with --resume"
        )
    elif args.out:
        print(f"wrote {args.out}/model, log.jsonl, training.png")
    return 0


def _config_overrides(text: str | None) -> dict:
    """``key=value,key=value`` -> {key: value}, values parsed as JSON where they can be."""
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, eq, raw = item.partition("=")
        if not eq:
            raise InputError(f"--config takes key=value pairs, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _objective(model) -> str:

    return family_of(model).objective


def cmd_study(args: argparse.Namespace) -> int:
    path = args.study or DEFAULT_STUDY
    if args.dry_run or args.processes != 1:  # what N processes cannot split: refused before they start
        described = plan(path, processes=args.processes, executor=args.executor, smoke=args.smoke)
        if args.dry_run:
            print(described)
            return 0
    return _in_processes(args, _study)


def _study(args: argparse.Namespace, state) -> int:
    out = run_study(
        args.study or DEFAULT_STUDY, args.out, smoke=args.smoke, executor=args.executor, address=args.address
    )
    if is_first():
        print(f"wrote {out}/report.md, metrics.json and plots")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    found = audit(
        args.model,
        args.out,
        budget=args.budget,
        within=args.within,
        variant=args.variant,
        dtype=args.dtype,
        placement=_placement(args),
        schemes=args.schemes.split(",") if args.schemes else None,
        docs=args.docs,
        export=not args.no_export,
        serve=args.serve,
        against=args.against,
    )
    print(found.answer, end="")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    if not Path(args.run).is_dir():
        raise MissingFile(f"no study run directory {args.run}")
    read_metrics(args.run)  # a missing or corrupt metrics.json: the reader's line, naming the file and field
    # a study run of quantgate's, without a link out of it, before the lock or a plot is written there
    claim_output(args.run, "study", "RUN", fix="give the folder `quantgate study` wrote")
    with run_lock(args.run):  # not while a study is writing there
        print(f"wrote {write_study_report(args.run, args.cluster, args.migrate)}")
    return 0


def cmd_build_tokenizers(args: argparse.Namespace) -> int:
    out = claim_output(args.out or TOKENIZER_DIR, "tokenizers", "--out", mark=True, by="quantgate build-tokenizers")
    for path in build_bundled(out):
        print(f"wrote {path}")
    return 0


def _int_or_text(text: str) -> int | str:
    """An option that takes a number or a word ('auto'): the number as an int, so that its range is checked."""
    try:
        return int(text)
    except ValueError:
        return text


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per command, each added by its own function below."""
    parser = argparse.ArgumentParser(prog="quantgate", description=__doc__)

    parser.add_argument("--version", action="version", version=f"quantgate {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error, not one line")
    sub = parser.add_subparsers(dest="command", required=True)
    _info_parser(sub)
    _observe_parser(sub)
    _quantize_parser(sub)
    _eval_parser(sub)
    _lm_eval_parser(sub)
    _compare_parser(sub)
    _train_parser(sub)
    _study_parser(sub)
    _audit_parser(sub)
    _report_parser(sub)
    _build_tokenizers_parser(sub)
    return parser


def _info_parser(sub: Any) -> None:
    """``quantgate info``."""
    info = sub.add_parser("info", help="family, parameter count (gates separately), variant and dtype of a model")
    info.add_argument("model", nargs="?", help="a preset name or a model directory")
    info.add_argument("--variant", help="attention variant to swap in, e.g. g1-elementwise:pi_init=0.25")
    info.add_argument("--list", action="store_true", help="list presets and variants")
    info.set_defaults(func=cmd_info)


def _observe_parser(sub: Any) -> None:
    """``quantgate observe``."""
    obs = sub.add_parser("observe", help="outlier, sink and gate statistics over a dataset, with plots")
    obs.add_argument("model", help="a preset, packaged model or model directory")
    obs.add_argument("--variant", help="attention variant to swap in")
    obs.add_argument("--data", default="validation", help="text source (default: the bundled validation split)")
    obs.add_argument("--out", default="runs/observe", help="output directory (default: runs/observe)")
    obs.add_argument("--seq-len", type=int, default=128)
    obs.add_argument("--batch-size", type=int, default=8)
    obs.add_argument("--max-batches", type=int, default=8)
    _placement_arguments(obs)
    obs.add_argument("--sink-tokens", type=int, default=1, help="how many leading keys count as the sink (>= 1)")
    obs.set_defaults(func=cmd_observe)


def _quantize_parser(sub: Any) -> None:
    """``quantgate quantize``."""
    qz = sub.add_parser("quantize", help="post-training INT8/FP8 quantization (simulated or torchao/bitsandbytes)")
    qz.add_argument("model", nargs="?", help="a preset, packaged model or model directory")
    qz.add_argument("--scheme", help="scheme name, optionally name:key=value,... (see --list)")
    qz.add_argument("--list", action="store_true", help="list the schemes")
    qz.add_argument("--variant", help="attention variant to swap in first")
    _placement_arguments(qz)
    qz.add_argument("--calib", type=int, help="calibration batches (default: the scheme's, 16)")
    qz.add_argument(
        "--inplace",
        action="store_true",
        help="quantize the loaded model itself, no copy (for models a copy would not fit)",
    )
    qz.add_argument("--calib-data", default="train", help="calibration text source (default: train)")
    qz.add_argument("--seq-len", type=int, default=128)
    qz.add_argument("--batch-size", type=int, default=8)
    qz.add_argument("--out", help="write the quantized checkpoint here (an empty or new folder, or see --overwrite)")
    qz.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model quantgate saved in --out earlier (without it, a model there is refused)",
    )
    qz.add_argument(
        "--save-dtype",
        choices=("bfloat16", "float16"),
        help="store a compressed-tensors export's full-precision tensors (embeddings, norms, head) in this dtype",
    )
    qz.set_defaults(func=cmd_quantize)


def _eval_parser(sub: Any) -> None:
    """``quantgate eval``."""
    ev = sub.add_parser("eval", help="evaluate through lm-eval (bundled offline tasks or any lm-eval task online)")
    ev.add_argument("model", help="a preset, packaged model or model directory (float or quantized)")
    ev.add_argument("--tasks", default="quantgate_ppl", help="comma-separated tasks (default: quantgate_ppl)")
    ev.add_argument("--scheme", help="quantize with this scheme first (calibration on the train split)")
    ev.add_argument("--variant", help="attention variant to swap in first")
    _placement_arguments(ev)
    ev.add_argument("--limit", type=float, help="documents per task (a fraction when < 1)")
    ev.add_argument("--batch-size", default="auto", type=_int_or_text, help="'auto' or a number >= 1")
    ev.add_argument("--out", help="write eval.json here (quantgate compare reads it)")
    ev.add_argument(
        "--num-fewshot", type=int, help="few-shot examples per lm-eval task (lm-eval's --num_fewshot; default: 0)"
    )
    ev.add_argument(
        "--bootstrap-iters",
        type=int,
        default=0,
        help="lm-eval's standard errors (<metric>_stderr; perplexity by bootstrap resamples); default 0: none",
    )
    ev.add_argument(
        "--output-path",
        help="also write lm-eval's own results JSON here (a directory, as lm_eval --output_path; lm-eval tasks only)",
    )
    ev.add_argument(
        "--log-samples", action="store_true", help="with --output-path: lm-eval's per-sample jsonl files too"
    )
    ev.add_argument(
        "--processes",
        type=int,
        default=1,
        help="data-parallel: N processes (one per GPU; gloo on the CPU), lm-eval's requests split between them",
    )
    ev.set_defaults(func=cmd_eval)


def _lm_eval_parser(sub: Any) -> None:
    """``quantgate lm-eval``."""
    lme = sub.add_parser(
        "lm-eval",
        add_help=False,
        prefix_chars="\0",  # every argument, --help included, goes to lm-eval unread
        help="lm-eval's own command line (lm_eval ARGS) with quantgate's models (--model quantgate, "
        "quantgate-mlm) registered and its tasks on --include_path",
    )
    lme.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments, unchanged")
    lme.set_defaults(func=cmd_lm_eval)


def _compare_parser(sub: Any) -> None:
    """``quantgate compare``."""
    cmp = sub.add_parser("compare", help="float vs quantized metrics of several runs, with deltas and a plot")
    cmp.add_argument(
        "runs", nargs="+", help="run directories, eval.json files or lm-eval results JSON (lm_eval --output_path)"
    )
    cmp.add_argument(
        "--baseline",
        help="the run every other is compared with (a run directory, eval.json or lm-eval results JSON); "
        "default: each quantized run's float source, found by the sha256 its record holds",
    )
    cmp.add_argument(
        "--force-baseline",
        action="store_true",
        help="pair every run with --baseline even where a quantized run records another float source (sha256) "
        "or the runs' lm-eval settings differ (few-shot, task version, limit, ...); each such pairing is stated",
    )
    cmp.add_argument("--out", help="write compare.md, compare.csv and compare.png here")
    cmp.set_defaults(func=cmd_compare)


def _train_parser(sub: Any) -> None:
    """``quantgate train``."""
    tr = sub.add_parser("train", help="train from scratch (--preset) or fine-tune a checkpoint (--model), resumable")
    tr.add_argument("--preset", help="a preset to build and train from scratch")
    tr.add_argument("--model", help="a checkpoint, packaged model or hub id to fine-tune")
    tr.add_argument(
        "--variant",
        help="attention variant (on --model: adds a gate; use finetune=true to start from the pretrained function)",
    )
    tr.add_argument("--config", help="preset config overrides, e.g. num_hidden_layers=4,hidden_dropout_prob=0")
    tr.add_argument("--objective", choices=("clm", "mlm"), help="checked against the model (BERT: mlm, others: clm)")
    tr.add_argument("--steps", type=int)
    tr.add_argument("--stop-after", type=int, dest="stop_after", help="end this run at this step (resume later)")
    tr.add_argument("--batch-size", type=int, dest="batch_size", help="sequences per process per micro-step")
    tr.add_argument("--seq-len", type=int, dest="seq_len")
    tr.add_argument("--grad-accum", type=int, dest="grad_accum")
    tr.add_argument("--lr", type=float)
    tr.add_argument("--schedule", choices=("cosine", "linear", "constant"))
    tr.add_argument("--warmup", type=float, help="fraction of the steps (< 1) or a number of steps")
    tr.add_argument(
        "--data",
        help="text source (default: train) or backcopy[:start=chain,trigger_prob=P,triggers=N] "
        "(synthetic sink-inducing task)",
    )
    tr.add_argument("--eval-every", type=int, dest="eval_every")
    tr.add_argument("--observe-every", type=int, dest="observe_every")
    tr.add_argument("--checkpoint-every", type=int, dest="checkpoint_every")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", help="run directory (log.jsonl, checkpoints/, model/, training.png)")
    tr.add_argument(
        "--log-with",
        dest="log_with",
        choices=("tensorboard",),
        help="also log to TensorBoard (out/tensorboard/, through accelerate's trackers; pip install tensorboard)",
    )
    tr.add_argument("--resume", action="store_true", default=None, help="continue from the last checkpoint in --out")
    tr.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="remove an earlier run's files from --out first (without it or --resume, a run there is refused)",
    )
    tr.set_defaults(func=cmd_train)


def _study_parser(sub: Any) -> None:
    """``quantgate study``."""
    st = sub.add_parser("study", help="run a study YAML: train/load -> observe -> quantize -> evaluate -> report")
    st.add_argument("study", nargs="?", help="study file (default: the quickstart study shipped with quantgate)")
    st.add_argument("--out", help="run directory (default: results/<study name>)")
    st.add_argument("--dry-run", action="store_true", help="validate the study and print its grid; run nothing")
    st.add_argument(
        "--smoke",
        action="store_true",
        help="run a shrunk copy (first variant, 4 steps, one batch per step) to check the file in seconds",
    )
    st.add_argument(
        "--executor",
        choices=EXECUTORS,
        help="where the cells run: serial (this process, the default) or ray (a Ray task per cell; the study "
        "file's executor: otherwise)",
    )
    st.add_argument(
        "--address", help="the Ray cluster for --executor ray (default: RAY_ADDRESS, else a Ray started here)"
    )
    st.add_argument(
        "--processes",
        type=int,
        default=1,
        help="data-parallel: N processes (one per GPU; gloo on the CPU) run the cells, each evaluation's "
        "requests split between them",
    )
    st.set_defaults(func=cmd_study)


def _audit_parser(sub: Any) -> None:
    """``quantgate audit``."""
    au = sub.add_parser(
        "audit",
        help="will MODEL survive INT8/FP8, and which recipe should it use? Whole-model schemes and per-layer "
        "fallbacks searched within a budget, the cheapest certified on held-out documents, exported",
    )
    au.add_argument(
        "model", help="a folder saved by transformers or quantgate, a packaged model or a hub id in the local cache"
    )
    au.add_argument("--out", help="where the audit goes (default: audits/<model name>)")
    au.add_argument("--budget", default="10m", help="time the whole audit may take here: 90s, 10m, 1h")
    au.add_argument(
        "--within", default="1%", help="the perplexity change a recipe may cause, e.g. 1%% or 0.01 (default 1%%)"
    )
    au.add_argument("--variant", help="the attention variant of a gated checkpoint (default: the one saved)")
    au.add_argument(
        "--against",
        metavar="GATED",
        help="a gated model of the same family and tokenizer: read on the same documents, calibration and schemes; "
        "each scheme reports its change minus MODEL's (the gate's effect) and the share of MODEL's damage removed",
    )
    au.add_argument("--schemes", help="try these whole-model schemes, comma-separated, instead of the default ones")
    au.add_argument(
        "--docs", type=int, help="passages (or batches) in each of the search and held-out sets (default: by budget)"
    )
    au.add_argument("--no-export", action="store_true", help="do not write the recipe to DIR/export")
    au.add_argument(
        "--serve",
        default="any",
        help="where the recipe will run: any (default) or vllm-cpu (only recipes vLLM-CPU has kernels for)",
    )
    _placement_arguments(au)
    au.set_defaults(func=cmd_audit)


def _report_parser(sub: Any) -> None:
    """``quantgate report``."""
    rp = sub.add_parser("report", help="rebuild a study's report.md and plots from its metrics.json")
    rp.add_argument("run", help="a study run directory")
    rp.add_argument(
        "--cluster",
        choices=CLUSTERS,
        help="the unit the intervals resample from now on (recorded in metrics.json; default: the study's, work)",
    )
    rp.add_argument(
        "--migrate",
        action="store_true",
        help="first write into an older run's metrics.json what it lacks (its documents' works and text hashes); "
        "without it metrics.json is left byte for byte as it is, and the report reads the same",
    )
    rp.set_defaults(func=cmd_report)


def _build_tokenizers_parser(sub: Any) -> None:
    """``quantgate build-tokenizers``."""
    tok = sub.add_parser("build-tokenizers", help="retrain the bundled BPE and WordPiece tokenizers on the train split")
    tok.add_argument("--out", help="output directory (default: the package's tokenizers folder)")
    tok.set_defaults(func=cmd_build_tokenizers)


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --processes starts again in each process
    logging.basicConfig(format="%(message)s")
    logging.getLogger("quantgate").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (QuantgateError, FileNotFoundError) as e:  # the user's input or setup (quantgate.errors; a file named
        # that is not there): one line; anything else is a bug, with its traceback
        if args.debug:
            raise
        print(f"quantgate {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or forbidden path: one line naming the file
        line = os_error_line(e, getattr(args, "out", None) or getattr(args, "run", None))
        if line is None or args.debug:
            raise
        print(f"quantgate {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was saved stays; one line says how to go on
        if args.debug:
            raise
        print(f"quantgate {args.command}: interrupted; {_rerun(args)}", file=sys.stderr)
        return 130


def _rerun(args: argparse.Namespace) -> str:
    """How to go on after an interrupted command: its command line again (a study reuses the steps it saved, a
    training run continues from its last checkpoint with --resume)."""
    argv = [a for a in args.argv if a != "--debug"]
    if args.command == "train" and getattr(args, "out", None) and "--resume" not in argv:
        argv = [*[a for a in argv if a != "--overwrite"], "--resume"]
        return f"continue from the last checkpoint with: quantgate {shlex.join(argv)}"
    kept = " (the steps already saved are reused)" if args.command == "study" else ""
    return f"run it again{kept}: quantgate {shlex.join(argv)}"


if __name__ == "__main__":
    sys.exit(main())
