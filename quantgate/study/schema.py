"""A study file's schema and its validation: :func:`load_study` reads the YAML into a :class:`Study`
(:mod:`.grid`), checking every value a run would meet before any work starts; errors name the YAML line
and the valid choices."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from accelerate.utils import PrecisionType

from ..data.batches import batch_count
from ..data.corpus import BUNDLED_SPLITS, DATASETS, hf_spec
from ..data.synthetic import is_backcopy, task_options
from ..errors import InputError, MissingDependency, MissingFile, QuantgateError
from ..eval.checks import check_limit
from ..eval.evaluate import unknown_tasks
from ..eval.tasks import bundled
from ..files import is_folder_name
from ..models.cost import check_memory
from ..models.families import family_of, get_family
from ..models.io import DTYPES, Placement, read_config
from ..models.presets import PRESETS, preset_config
from ..models.sources import PACKAGED, resolve, tokenizer
from ..models.swap import check_expressible
from ..options import AT_LEAST_1, SEED, Option, Range
from ..quant.schemes import OPTIONS, get_scheme
from ..stats import CLUSTERS
from ..train import TRAIN_RANGES, TrainConfig
from ..variants import AttentionVariant
from ..yaml_file import read_yaml
from .executors import EXECUTORS, RESOURCES, check_resources
from .grid import (
    Cell,
    DataSettings,
    EvalSettings,
    LoadSource,
    ModelSource,
    ModelSpec,
    ObserveSettings,
    PresetSource,
    SchemeEntry,
    Study,
    Written,
    expand_scheme,
    slug,
)

__all__ = ["load_study", "StudyError", "DEFAULT_STUDY"]

DEFAULT_STUDY = Path(__file__).parents[1] / "studies" / "quickstart.yaml"  # the main job, shipped in the package
HUB_ID = r"[\w-][\w.-]*/[\w.-]+"  # owner/name


class StudyError(InputError):
    """A study file that cannot run; the message names the line and the valid choices."""


# --- the schema ------------------------------------------------------------------------------------

SECTION_KEYS: dict[str, dict[str, Any]] = {
    "calibration": {"data": "train", "batches": 16, "seq_len": 128, "batch_size": 8},
    "observe": {"data": "validation", "batches": 3, "seq_len": 128, "batch_size": 8, "sink_tokens": 1},
    "eval": {"tasks": ["quantgate_ppl"], "limit": None, "batch_size": "auto"},
    "report": {"notes": ""},
}
TOP_KEYS = {"name", "description", "seed", "models", "variants", "schemes", "executor", "out", *SECTION_KEYS}
MODEL_KEYS = {
    "name",
    "preset",
    "load",
    "config",
    "train",
    "variants",
    "schemes",
    "eval",
    "observe",
    "calibration",
    "seeds",
    "dtype",
    "resources",
    "placement",
}
TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} - {"out", "resume", "overwrite", "extra", "stop_after"}

# Each value a study sets: an Option (type, its range or None); None values take the defaults. The ranges are the ones
# the command line checks its options against (quantgate.options): one definition for both doors


def _inside(folder: str) -> bool:
    """Whether ``folder`` names a folder inside the study file's own (``out:``): relative, without ``..``."""
    return bool(folder.strip()) and not Path(folder).is_absolute() and ".." not in Path(folder).parts


def _limit(name: str, default: int) -> int:
    """The file system's limit ``name`` (PC_NAME_MAX, PC_PATH_MAX) in bytes, ``default`` where it cannot say."""
    try:
        return os.pathconf("/", name)
    except (OSError, ValueError, AttributeError):  # not POSIX, or no such limit
        return default


NAME_MAX = _limit("PC_NAME_MAX", 255)  # the bytes of one file or folder name (ENAMETOOLONG beyond)
PATH_MAX = _limit("PC_PATH_MAX", 4096)  # the bytes of a whole path, with its closing NUL
CELL_FILES = 96  # room for the longest path a cell writes under its folder (train/checkpoints/step-N/...)
SCHEME_FILE = "scheme-{}.json"  # a cell's per-scheme step file (quantgate.study.steps: Step "scheme"), its longest name


def _is_name(name: str) -> bool:
    return is_folder_name(name) and len(os.fsencode(name)) <= NAME_MAX


Rules = dict[str, Option]  # key: its type hint and range (or None)
FOLDER_NAME = Range(_is_name, f"without / or \\, not '.' or '..', at most {NAME_MAX} bytes (it names a folder)")
TRAIN_RULES: Rules = {
    k: Option(t, TRAIN_RANGES.get(k)) for k, t in typing.get_type_hints(TrainConfig).items() if k in TRAIN_KEYS
}
TOP_RULES: Rules = {
    "name": Option(str, FOLDER_NAME),
    "description": Option(str),
    "seed": Option(int, SEED),
    "variants": Option(list[str]),
    "schemes": Option(list),
    "models": Option(list),
    "executor": Option(str, Range(lambda e: e in EXECUTORS, f"one of {', '.join(EXECUTORS)}")),
    "out": Option(
        str, Range(_inside, "a folder relative to the study file, inside its folder")
    ),  # default results/<name>
}
MODEL_RULES: Rules = {
    "name": Option(str, FOLDER_NAME),
    "preset": Option(str),
    "load": Option(str),
    "config": Option(dict | None),
    "train": Option(dict | None),
    "variants": Option(list[str]),
    "schemes": Option(list),
    "seeds": Option(list[int], Range(lambda s: all(x in SEED for x in s), f"each {SEED.wants}")),
    "eval": Option(dict | None),
    "observe": Option(dict | None),
    "dtype": Option(str, Range(lambda d: d in DTYPES, f"one of {', '.join(DTYPES)}")),
    "resources": Option(dict, Range(check_resources, f"keys among {', '.join(RESOURCES)}, each a number >= 0")),
    "placement": Option(dict),  # Placement's fields: _check_placement
}
DATA_RULES: Rules = {
    "data": Option(str),
    "batches": Option(int, AT_LEAST_1),
    "seq_len": Option(int, AT_LEAST_1),
    "batch_size": Option(int, AT_LEAST_1),
}
SECTION_RULES: dict[str, Rules] = {
    "calibration": DATA_RULES,
    "observe": {**DATA_RULES, "sink_tokens": Option(int, AT_LEAST_1)},
    "eval": {
        "tasks": Option(list[str]),
        "limit": Option(float | dict[str, float | None] | None),  # values: _check_limit
        "batch_size": Option(
            int | str, Range(lambda x: x == "auto" if isinstance(x, str) else x >= 1, "'auto' or >= 1")
        ),
        "max_length": Option(int, AT_LEAST_1),
    },  # lm-eval's window (tokens); default: see _eval_settings
    "report": {
        "notes": Option(str),  # pairs: [[ungated model, gated model], ...] the report opens with
        "criterion": Option(str),  # the experiment's success criterion, committed before its runs
        "pairs": Option(list[list[str]], Range(lambda ps: all(len(p) == 2 for p in ps), "each [ungated, gated]")),
        "baseline": Option(str),  # a variant the report sets every other variant of a model against
        "fixes": Option(dict),
        # the unit the intervals resample: "work" (documents of one work together; the default) or "document"
        "cluster": Option(str, Range(lambda c: c in CLUSTERS, " or ".join(repr(c) for c in CLUSTERS))),
    },  # {reference: scheme, within: fraction}: the report opens with a ranking
}


def _check_placement(m: dict, at: tuple, fail) -> None:
    """A model's ``placement:``: accelerate's big-model loading of a checkpoint (:class:`Placement`)."""
    placement = m["placement"]
    if "load" not in m or m.get("train") is not None:
        fail(
            at,
            "placement shards a checkpoint as it loads: give the model 'load:' and no 'train:' (train a model "
            "too big for one device with FSDP: accelerate launch -m quantgate.cli train)",
        )
    if "device_map" not in placement:
        fail(at, "placement needs device_map: auto, balanced, sequential, or {module: GPU index, cpu or disk}")
    try:
        Placement(**placement)
    except InputError as e:
        fail(at, str(e))


def _compose(path: Path):
    """The study file -> (python data, {key path: line number}), read by the bounded YAML reader (no anchors
    or aliases, no key given twice: :func:`quantgate.yaml_file.read_yaml`)."""
    try:
        return read_yaml(path)
    except InputError as e:  # "<file>:<line>: <why>"
        raise StudyError(str(e)) from None


def load_study(path: str | Path) -> Study:
    """Read and validate a study file; every problem a run would meet raises StudyError (naming the YAML
    line) before any work starts."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"no study file {path}; the default study is {DEFAULT_STUDY}")
    r = _Reader(path)
    data = r.data
    _check_nul(data, (), r.fail)
    r.check_keys(data, TOP_KEYS, ())
    _check_values(data, TOP_RULES, (), r.fail)
    if not data.get("models"):
        r.fail(("models",), "a study needs a non-empty 'models' list")
    sections = {}
    for sec, defaults in SECTION_KEYS.items():
        given = data.get(sec) or {}
        r.check_keys(given, set(SECTION_RULES[sec]), (sec,))
        _check_values(given, SECTION_RULES[sec], (sec,), r.fail)
        sections[sec] = {**defaults, **given}
    _check_limit(sections["eval"], ("eval",), r.fail)
    seed = data.get("seed", 0)
    models = [r.model(i, m, sections, seed) for i, m in enumerate(data["models"])]
    study = Study(
        data.get("name") or path.stem,
        data.get("description", ""),
        models,
        DataSettings(**sections["calibration"]),
        sections["report"],
        executor=data.get("executor", "serial"),
        out=path.parent / data["out"] if "out" in data else None,
    )
    _check_folders(study, r.lines, r.fail)
    _check_paths(study, r.lines, r.fail)
    if study.out is not None and not study.out.resolve().is_relative_to(path.parent.resolve()):
        r.fail(("out",), f"out: {data['out']!r} leads through a link to {study.out.resolve()}, outside the study "
               f"file's folder; name a folder inside it (or give --out)")  # fmt: skip
    r.check_report(sections["report"], models)
    default = path.resolve() == DEFAULT_STUDY.resolve()  # recorded as "": `quantgate study` reruns it anywhere
    study.raw = {
        "name": study.name,
        "file": "" if default else str(path),
        "description": study.description,
        "seed": seed,
        "models": [m.as_dict() for m in models],
        **{k: sections[k] for k in ("calibration", "report")},
    }
    return study


class _Reader:
    """A study file being read: its data, the YAML line of each key path, and the checks that name that line
    (:meth:`fail` raises StudyError ``FILE:LINE: message``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data, self.lines = _compose(path)

    def fail(self, where: tuple, message: str) -> NoReturn:
        raise StudyError(f"{self.path}:{_line(self.lines, where)}: {message}")

    def first(self, *paths: tuple) -> tuple:
        """The first of ``paths`` the file sets: where a merged setting (model's, else study's) was written."""
        return next((p for p in paths if p in self.lines), paths[-1])

    def check_keys(self, obj: Any, valid: Iterable[str], where: tuple) -> None:
        if not isinstance(obj, dict):
            self.fail(where, f"expected a mapping with keys {', '.join(sorted(valid))}")
        for key in obj:
            if key not in valid:
                self.fail((*where, key), f"unknown key {key!r}; valid: {', '.join(sorted(valid))}")

    def model(self, i: int, m: Any, sections: dict[str, dict], seed: int) -> ModelSpec:
        """The ``models`` entry ``i``, checked section by section, with the study's sections merged in."""
        where = ("models", i)
        self.check_keys(m, MODEL_KEYS, where)
        _check_values(m, MODEL_RULES, where, self.fail)
        if ("preset" in m) == ("load" in m):
            self.fail(where, "each model needs exactly one of 'preset' (built from config) or 'load' (a checkpoint)")
        if "preset" in m and m["preset"] not in PRESETS:
            self.fail((*where, "preset"), f"unknown preset {m['preset']!r}; valid: {', '.join(PRESETS)}")
        config, family = _model_config(m, where, self.fail)
        name = str(m.get("name") or m.get("preset") or m.get("load"))
        train = m.get("train")
        if train is not None:
            self.train(train, (*where, "train"), config, family)
        if m.get("placement") is not None:
            self.check_keys(m["placement"], {f.name for f in dataclasses.fields(Placement)}, (*where, "placement"))
            _check_placement(m, (*where, "placement"), self.fail)
        elif family is not None and self.data.get("executor", "serial") == "serial":  # a Ray worker's is not here
            self.memory(name, m, where, config, family)
        variants = m.get("variants", self.data.get("variants") or ["vanilla"])
        self.variants(variants, m, where, config, family)
        for sec in ("eval", "observe", "calibration"):
            self.check_keys(m.get(sec) or {}, set(SECTION_RULES[sec]), (*where, sec))
            _check_values(m.get(sec) or {}, SECTION_RULES[sec], (*where, sec), self.fail)
        ev = {**sections["eval"], **(m.get("eval") or {})}
        _check_tasks(ev["tasks"], (*where, "eval") if "eval" in m else ("eval", "tasks"), self.fail)
        if "limit" in (m.get("eval") or {}):
            _check_limit(ev, (*where, "eval"), self.fail)
        schemes = self.schemes(m, where, ev["tasks"])
        ob = {**sections["observe"], **(m.get("observe") or {})}
        if ob["sink_tokens"] >= ob["seq_len"]:
            self.fail(
                self.first((*where, "observe", "sink_tokens"), ("observe", "sink_tokens"), where),
                f"sink_tokens ({ob['sink_tokens']}) must be fewer than observe's seq_len ({ob['seq_len']})",
            )
        cal = {**sections["calibration"], **(m.get("calibration") or {})}
        objective = family.objective if family else None
        for sec, cfg in (("observe", ob), ("calibration", cal)):
            _check_source(cfg["data"], self.first((*where, sec, "data"), (sec, "data"), where), self.fail, objective)
            at = self.first((*where, sec, "seq_len"), (sec, "seq_len"), where)
            _check_seq_len(family, config, sec, cfg["seq_len"], at, self.fail)
            if family is not None:
                self.data_size(m, sec, cfg, self.first((*where, sec, "batches"), (sec, "batches"), where), family)
        source: ModelSource = (
            PresetSource(m["preset"], m.get("config") or {}) if "preset" in m else LoadSource(str(m["load"]))
        )
        placement = m.get("placement")
        return ModelSpec(
            name,
            source,
            None if train is None else Written(TrainConfig(**train), train),
            list(variants),
            list(schemes),
            EvalSettings(**ev),
            ObserveSettings(**ob),
            list(m.get("seeds") or [seed]),
            DataSettings(**cal),
            m.get("dtype") if m.get("dtype") != "float32" else None,
            m.get("resources"),
            None if placement is None else Written(Placement(**placement), placement),
        )

    def memory(self, name: str, m: dict, where: tuple, config: Any, family: Any) -> None:
        """The model fits in the memory free where its cells run (the audit's check: :func:`check_memory`)."""
        fix = (
            "give it a smaller config: (hidden_size, num_hidden_layers, ...)"
            if "preset" in m
            else "give it placement: {device_map: auto} to shard it as it loads"
        )
        try:
            check_memory(name, family, config, m.get("dtype") or "float32", fix, train=m.get("train") is not None)
        except InputError as e:
            self.fail(self.first((*where, "config"), (*where, "load"), where), str(e))

    def data_size(self, m: dict, sec: str, cfg: dict, at: tuple, family: Any) -> None:
        """``sec``'s batches (calibration, observe) no more than one pass over its data holds for this model's
        tokenizer: the bundled splits and the backcopy task (other sources are read when the run loads them)."""
        data, wanted = cfg["data"], cfg["batches"]
        if data not in BUNDLED_SPLITS and not is_backcopy(data):
            return
        try:
            tok = tokenizer(m.get("preset") or m["load"])
        except (QuantgateError, OSError):  # no tokenizer to count with: the run says why
            return
        try:
            held = batch_count(
                tok, data, cfg["seq_len"], cfg["batch_size"], family.objective, wanted if sec == "observe" else None
            )
        except InputError as e:  # a tokenizer that cannot make this model's batches of the data (no EOS token)
            self.fail(at, f"{sec} data {data!r}: {e}")
        if held < wanted:
            what = f"the {data} split holds" if data in BUNDLED_SPLITS else f"the {data} task's {sec} set holds"
            self.fail(
                at,
                f"{sec} batches {wanted}: {what} {held:,} batches of {cfg['batch_size']} x {cfg['seq_len']} tokens "
                f"for this model's tokenizer; give batches: {held} or fewer",
            )

    def train(self, train: Any, at: tuple, config: Any, family: Any) -> None:
        """A model's ``train`` section: its keys and values, the trainer's own checks, its data sources."""
        self.check_keys(train, TRAIN_KEYS, at)
        _check_values(train, TRAIN_RULES, at, self.fail)
        _check_precision(train.get("mixed_precision", TrainConfig.mixed_precision), (*at, "mixed_precision"), self.fail)
        try:
            TrainConfig(**train).resolved(family.name if family else "opt")  # unknown yet: a recipe to check with
        except InputError as e:  # the trainer's own check of the schedule
            self.fail((*at, "schedule"), str(e))
        objective = family.objective if family else None
        for key in ("data", "eval_data"):
            if train.get(key) is not None:
                _check_source(train[key], (*at, key), self.fail, objective)
        seq_len = train.get("seq_len", TrainConfig.seq_len)
        _check_seq_len(family, config, "train", seq_len, self.first((*at, "seq_len"), at), self.fail)

    def variants(self, variants: list, m: Any, where: tuple, config: Any, family: Any) -> None:
        """Each variant of a model parses and fits its family (a loaded model: a gate it can take)."""
        for j, v in enumerate(variants):
            at = (*where, "variants", j) if "variants" in m else self.first(("variants", j), where)
            try:
                variant = AttentionVariant.parse(v)
            except InputError as e:
                self.fail(at, str(e))
            try:
                _check_variant(variant, family, config, loaded="load" in m)
            except InputError as e:
                self.fail(at, f"variant {v!r}: {e}")

    def schemes(self, m: Any, where: tuple, model_tasks: list[str]) -> list[SchemeEntry]:
        """A model's scheme entries (its own, else the study's), each expanded (bit sweeps) with its tasks, a
        subset of the model's."""
        schemes = []
        for j, s in enumerate(m.get("schemes", self.data.get("schemes") or [])):
            at = (*where, "schemes", j) if "schemes" in m else ("schemes", j)
            entry = s if isinstance(s, dict) else {"scheme": s}
            self.check_keys(entry, {"scheme", "tasks", *OPTIONS}, at)
            try:
                names = expand_scheme(entry)
            except InputError as e:
                self.fail(at, str(e))
            tasks = entry.get("tasks")
            if tasks is not None and not set(tasks) <= set(model_tasks):
                self.fail(
                    (*at, "tasks"),
                    f"a scheme evaluates a subset of the model's tasks ({', '.join(model_tasks)}), "
                    f"so that its numbers compare with the float model's; got {tasks}",
                )
            for name in names:
                if len(os.fsencode(SCHEME_FILE.format(slug(name)))) > NAME_MAX:
                    self.fail(at, f"scheme {name!r} names a file of more than {NAME_MAX} bytes; give fewer keep= sites")
            schemes += [SchemeEntry(name, tasks) for name in names]
        return schemes

    def check_report(self, report: dict, models: list[ModelSpec]) -> None:
        """The report section names models, a baseline variant and fixes the study has."""
        names = [m.name for m in models]
        for i, pair in enumerate(report.get("pairs") or []):
            for name in pair:
                if name not in names:
                    self.fail(
                        ("report", "pairs", i),
                        f"pair {pair} names {name!r}, not a model of this study; models: {', '.join(names)}",
                    )
        baseline = report.get("baseline")
        if baseline is not None and not any(baseline in m.variants for m in models):
            self.fail(
                ("report", "baseline"),
                f"baseline {baseline!r} is not a variant of any model; variants: "
                f"{', '.join(sorted({v for m in models for v in m.variants}))}",
            )
        fixes = report.get("fixes")
        if fixes is not None:
            schemes = {e.scheme for m in models for e in m.schemes}
            _check_fixes(fixes, schemes, lambda msg: self.fail(("report", "fixes"), msg))


def _check_fixes(fixes: dict, schemes: set[str], fail) -> None:
    """``report: fixes: {reference: SCHEME, within: FRACTION}``: the scheme the fixes are set against (one of the
    study's) and the perplexity increase that counts as fixed (default 0.01)."""
    unknown = set(fixes) - {"reference", "within"}
    if unknown:
        fail(f"unknown key(s) {', '.join(sorted(unknown))}; valid: reference, within")
    try:
        reference = str(get_scheme(fixes.get("reference", "")))
    except InputError as e:
        return fail(f"reference: {e}")
    if reference not in schemes:
        fail(f"reference {reference!r} is not a scheme of this study; schemes: {', '.join(sorted(schemes))}")
    within = fixes.get("within", 0.01)
    if isinstance(within, bool) or not isinstance(within, (int, float)) or not 0 < within < 1:
        fail(f"within must be a fraction in (0, 1) (0.01: within 1% of float), got {within!r}")


def _line(lines: dict, where: tuple) -> int:
    return lines.get(where) or lines.get(where[:-1]) or 1


def _fits(value, hint) -> bool:
    """Whether a YAML value has the type ``hint`` (int, float, str, list[...], tuple[...], dict[...], X | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(_fits, value, args))
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint) if hint is not type(None) else value is None


def _check_values(given: dict, rules: dict, where: tuple, fail) -> None:
    """Check each value of ``given`` against its rule, an :class:`~quantgate.options.Option` (type, range)."""
    for key, value in given.items():
        rule = rules.get(key, Option(object))
        if _fits(value, rule.type) and (value is None or rule.accepts(value)):
            continue
        wants = re.sub(r"<class '(\w+)'>|typing\.", r"\1", str(rule.type)) + (f", {rule.wants}" if rule.valid else "")
        fail((*where, key), f"{key} must be {wants}; got {value!r}{_number_as_text(value)}")


def _number_as_text(value) -> str:
    """A note for numbers YAML 1.1 reads as text: 1e-3 (an exponent needs a point and a sign: 1.0e-3)."""
    if not (isinstance(value, str) and "e" in value.lower()):
        return ""
    try:
        number = float(value)
    except ValueError:  # not a number at all
        return ""
    if not math.isfinite(number):
        return ""
    text = str(int(number)) if number.is_integer() else re.sub(r"^(-?\d+)e", r"\1.0e", repr(number))
    return f" (YAML reads {value} as text; write {text})"


def _check_precision(value, where: tuple, fail) -> None:
    choices = ("auto", *PrecisionType.list())
    if value not in choices:
        fail(where, f"mixed_precision must be one of {', '.join(choices)}; got {value!r}")


def _check_limit(ev: dict, where: tuple, fail) -> None:
    """Each limit is one evaluate accepts (:func:`quantgate.eval.checks.check_limit`), and a per-task limit
    names only tasks the evaluation runs (a misspelt task would run in full)."""
    limit = ev["limit"]
    unknown = sorted(set(limit) - set(ev["tasks"])) if isinstance(limit, dict) else []
    if unknown:
        fail(
            (*where, "limit", unknown[0]),
            f"limit names {', '.join(map(repr, unknown))}, not among the evaluated tasks ({', '.join(ev['tasks'])})",
        )
    for task, value in limit.items() if isinstance(limit, dict) else [(None, limit)]:
        try:
            check_limit(value)
        except InputError as e:
            fail((*where, "limit", task) if task else (*where, "limit"), str(e))


def _check_source(source: str, where, fail, objective: str | None = None) -> None:
    if is_backcopy(source):
        if objective == "mlm":
            fail(where, f"data source {source!r} is a causal-LM task and this model is a masked LM; use a text source")
        try:
            task_options(source)
        except InputError as e:
            fail(where, str(e))
        return
    if source in BUNDLED_SPLITS:
        return
    if source.startswith("hf:") or source.split(":")[0] in DATASETS:
        try:
            hf_spec(source)
        except InputError as e:
            fail(where, str(e))
        return
    fail(
        where,
        f"unknown data source {source!r}; valid: {', '.join(BUNDLED_SPLITS)}, backcopy[:key=value,...], "
        f"{', '.join(f'{d}:<split>' for d in DATASETS)}, hf:<dataset>[@<config>]:<split>",
    )


def _check_tasks(tasks, where, fail) -> None:
    for t in unknown_tasks(tasks):
        fail(where, f"unknown task {t!r}; bundled: {', '.join(bundled())} (any lm-eval task name online)")


def _model_config(m: dict, where: tuple, fail):
    """The transformers config and family a model will have: its preset's with the study's overrides, or its
    checkpoint's. (None, None) where reading it would take long (a packaged GGUF model, converted on first
    load) or needs the network (a hub id): the run checks those when it loads them."""
    if "preset" in m:
        overrides = m.get("config") or {}
        try:  # the check qg.build and `train --config` make
            config = preset_config(m["preset"], overrides)
        except InputError as e:
            key = next((k for k in overrides if re.search(rf"\b{re.escape(str(k))}\b", str(e))), None)
            fail((*where, "config", key) if key else (*where, "config"), f"config: {e}")
        return config, get_family(PRESETS[m["preset"]].family)
    load = m["load"]
    if (load in PACKAGED and PACKAGED[load].gguf_file) or (re.fullmatch(HUB_ID, load) and not Path(load).exists()):
        return None, None
    if load not in PACKAGED and not Path(load).exists():
        fail(
            (*where, "load"),
            f"cannot load {load!r}: no such checkpoint directory; give a packaged model "
            f"({', '.join(PACKAGED)}), a checkpoint directory or a hub id (owner/name)",
        )
    try:
        config = read_config(resolve(load))
    except (InputError, MissingFile, MissingDependency) as e:
        fail((*where, "load"), f"cannot load {load!r}: {e}")
    try:
        return config, family_of(config)
    except InputError as e:
        fail((*where, "load"), f"cannot load {load!r}: {e}")


def _check_variant(variant: AttentionVariant, family, config, loaded: bool) -> None:
    """Raise InputError when the run could not swap ``variant`` into the model (the check of
    :func:`~quantgate.models.swap.apply_variant`). A loaded model's 'vanilla' means its own attention."""
    if family is not None and not (loaded and variant.is_vanilla):
        check_expressible(family, variant, config)


def _check_folders(study: Study, lines: dict, fail) -> None:
    """Two cells must not share a run folder (names that differ only in characters a folder name drops)."""
    seen: dict[str, Cell] = {}
    for cell in study.cells():
        other = seen.setdefault(cell.slug, cell)
        if other is not cell:
            i, j = (next(n for n, m in enumerate(study.models) if m is c.model) for c in (other, cell))
            at = [("models", n, "name") if ("models", n, "name") in lines else ("models", n) for n in (i, j)]
            fail(
                at[1],
                f"cells {other.id!r} (line {_line(lines, at[0])}) and {cell.id!r} (line "
                f"{_line(lines, at[1])}) would share the folder cells/{cell.slug}: give the models "
                f"names that differ in letters, digits or . _ -",
            )


def _check_nul(value: Any, where: tuple, fail) -> None:
    """No text of the study file holds a NUL character: no name or path can (the OS refuses it mid-run)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_nul(k, where, fail)
            _check_nul(v, (*where, k), fail)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_nul(v, (*where, i), fail)
    elif isinstance(value, str) and "\0" in value:
        key = next((k for k in reversed(where) if isinstance(k, str)), "a value")
        fail(where, f"{key} {value!r} holds a NUL character (\\0), which no name or path may hold; remove it")


def _check_paths(study: Study, lines: dict, fail) -> None:
    """The run's folder (``out:``, else results/<name> here) and each cell's a path the OS takes: every name in it
    at most :data:`NAME_MAX` bytes, the longest path a cell writes at most :data:`PATH_MAX` bytes."""
    at = ("out",) if study.out is not None else ("name",)
    run = Path(os.path.abspath(study.out if study.out is not None else Path("results") / study.name))
    for part in run.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            fail(at, f"{at[0]}: the run folder's name {part[:40]!r}... is more than {NAME_MAX} bytes; shorten it")
    for cell in study.cells():
        files = max([CELL_FILES, *(len(os.fsencode(SCHEME_FILE.format(slug(e.scheme)))) for e in cell.model.schemes)])
        longest = len(os.fsencode(run / "cells" / cell.slug)) + 1 + files
        if len(os.fsencode(cell.slug)) > NAME_MAX:
            i = next(n for n, m in enumerate(study.models) if m is cell.model)
            where = ("models", i, "name") if ("models", i, "name") in lines else ("models", i)
            fail(where, f"cell {cell.id!r}'s folder name is more than {NAME_MAX} bytes; give the model a shorter name")
        if longest >= PATH_MAX:
            fail(
                at,
                f"{at[0]}: the run's files would have paths of {longest:,} bytes under {str(run)[:40]}..., more than "
                f"the {PATH_MAX} bytes a path may have here; give a shorter out:",
            )


def _check_seq_len(family, config, section: str, seq_len: int, where: tuple, fail) -> None:
    """A section's seq_len the model's positions can hold (a family without the config, a packaged GGUF or hub
    model, is checked when it loads)."""
    if family is None:
        return
    try:
        family.check_seq_len(config, seq_len)
    except InputError as e:
        fail(where, f"{section} seq_len: {e}")
