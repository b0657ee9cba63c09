"""Every file quantgate writes has exactly one writer and one reader (issue 58's acceptance).

:data:`FILES` lists each kind of file quantgate writes in a format of its own: where it lies in the folder it belongs
to (a glob matched from the right, one ``*`` per path part), the one function that writes it and the one that reads
it back (None: a page or a plot for people, or a file nothing reads; a class: its methods together). :data:`OTHERS`
lists the files quantgate has another tool write in that tool's format (transformers' config.json and tokenizer
files, safetensors weights), which that tool reads too. Two checks hold the table to the code:

1. Real runs (a study and its report rebuilt with ``--cluster``, training and its resume, qg.save of a float and a
   quantized model, quantgate eval, compare and observe) under an audit hook (:func:`sys.addaudithook`: every file
   opened, every rename) record each file written or read and the function that did it: the innermost function of
   the package that is not a generic I/O helper (:data:`HELPERS`, which write and read the paths their callers give
   them). Every file written is in :data:`FILES` or :data:`OTHERS`, and each file of :data:`FILES` is written only
   by its writer and read only by its reader.
2. The code, read as an AST: every function that hands one of :data:`FILES`' names (a literal, or a module constant
   bound to one) to a write or a read (:data:`WRITES`, :data:`READS`, ``open``) is that file's writer or reader, so
   the paths the runs do not take (an older run migrated, an older output folder recognized) are held to the same
   rule; and every file name the package spells is in one of the tables.

What the code does not yet do is :data:`NOT_YET`: each a second writer or reader, with why it is there; the test
fails when one is added, and when one listed is gone (then its line goes too).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import FrameType
from typing import Any

import pytest
from conftest import TINY_STUDY, TINY_TRAIN

import quantgate as qg
from quantgate.cli import main
from quantgate.train import TrainConfig, train

PACKAGE = Path(qg.__file__).parent


@dataclass(frozen=True)
class Kind:
    """A kind of file quantgate writes: ``path``, a glob of its path (from the right, ``*`` one part);
    ``writer`` and ``reader``, qualified names of the functions (or a class) that write and read it (reader None:
    nothing in quantgate reads it); ``names``, what the code calls it (default: the last part of ``path`` where it
    is a name, not a pattern)."""

    path: str
    writer: str
    reader: str | None
    names: tuple[str, ...] | None = None

    def spelled(self) -> tuple[str, ...]:
        last = PurePosixPath(self.path).name
        return self.names if self.names is not None else (() if "*" in last else (last,))


Q = "quantgate."
STEP = (Q + "study.steps._write_json", Q + "study.steps._done")  # a study cell's step files
CHECKPOINT = (Q + "train.checkpoint._write_files", Q + "train.resume._load_checkpoint")  # a checkpoint's tensors
FILES = [
    # every output folder: who wrote it, and the lock and the write probe of the one writing now
    Kind(".quantgate", Q + "files.mark_output", Q + "files._marker"),
    Kind(".quantgate.lock", Q + "runlock.run_lock", Q + "runlock.run_lock"),  # the holder's pid, read by the next
    Kind(".quantgate-write-test.*", Q + "files._probe", None, (".quantgate-write-test.",)),  # made and removed
    # a study run
    Kind("config.yaml", Q + "study.steps.run_study", None),  # the study as run, for people to rerun
    Kind("metrics.json", Q + "study.records.write_metrics", Q + "study.records._metrics_object"),
    Kind("study_layers.png", Q + "study.report_plots.plot_study_layers", None),
    Kind("study_quant.png", Q + "study.report_plots.plot_study_quant", None),
    Kind("study_bits.png", Q + "study.report_plots.plot_bit_sweeps", None),
    Kind("study_training.png", Q + "study.report_plots.plot_study_training", None),
    Kind("study_fixes.png", Q + "study.report_plots.plot_fixes", None),
    Kind("cells/*/model.json", *STEP, ("model.json",)),
    Kind("cells/*/observe.json", *STEP, ()),  # the observe step's file; observe's own observe.json is below
    Kind("cells/*/eval-float.json", *STEP),
    Kind("cells/*/cost.json", *STEP),
    Kind("cells/*/scheme-*.json", *STEP),
    Kind("cells/*/cell.log", Q + "study.executors._cell_task", None),  # a Ray worker's log of its cell
    Kind(".quantgate-run-id", Q + "study.executors._on_ray", Q + "study.executors._cell_task"),
    Kind("cells/*/train/study-key", Q + "study.steps._materialise", Q + "study.steps._same_key"),
    Kind("report.md", Q + "study.report.write_study_report", None),
    Kind("experiment/report.md", Q + "experiment.write", None, ("report.md",)),  # experiments/*.py's (not run here)
    # quantgate observe (and a study cell's observe/)
    Kind("observe.json", Q + "observe.ObserveReport.save", Q + "observe.ObserveReport.load"),
    Kind("observe.md", Q + "observe.ObserveReport.save", None),
    Kind("observe_layers.png", Q + "plots.plot_observe", None),
    Kind("observe_sink.png", Q + "plots.plot_observe", None),
    Kind("observe_gates.png", Q + "plots.plot_observe", None),
    # quantgate eval and compare
    Kind("eval.json", Q + "cli._eval", Q + "study.compare._read_json"),
    Kind("eval.partial.json", Q + "cli._eval", None),  # what finished before a task's outputs were not finite
    Kind("lm_eval.partial.json", Q + "eval.lm_eval_models._keep", None),
    Kind("compare.md", Q + "study.compare.compare", None),
    Kind("compare.csv", Q + "study.compare._write_csv", None),
    Kind("compare.png", Q + "plots.bar_panels", None),
    # quantgate audit
    Kind("audit.json", Q + "audit.run._finish", Q + "audit.record.AuditRecord.read"),
    Kind("audit.md", Q + "audit.run._finish", None),
    # a training run
    Kind("log.jsonl", Q + "train.log.JsonLog", Q + "train.log.read_log"),  # written as it trains, kept up to a resume
    Kind("training.png", Q + "train.log.plot_training", None),
    Kind("checkpoints/*/trainer.json", Q + "train.checkpoint._write_files", Q + "train.checkpoint._read_trainer"),
    Kind("checkpoints/*/model.safetensors", *CHECKPOINT),
    Kind("checkpoints/*/optimizer.safetensors", *CHECKPOINT),
    Kind("checkpoints/*/rng-*.safetensors", Q + "train.rng.save_rng", Q + "train.rng._set_rng"),
    # a model qg.save wrote: quantgate's own files beside transformers' (OTHERS)
    Kind("quantization.json", Q + "quant.manifest.save_quantized", Q + "quant.imported.sidecar_json"),
    Kind("quantgate.safetensors", Q + "models.io.save", Q + "models.io.load"),
    Kind("quantized.safetensors", Q + "quant.manifest._write_weights", Q + "quant.manifest._read"),
    # the cache ($QUANTGATE_CACHE): what a content hash was, by size, times and inode
    Kind("content-sha256.json", Q + "files.content_sha256", Q + "files.content_sha256"),
]

# files quantgate has another tool write, in that tool's format (transformers' save_pretrained, which
# from_pretrained reads; the safetensors weights it writes beside them)
OTHERS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "model.safetensors",
    "model.safetensors.index.json",
)
# file names the package spells that are no file it writes: inputs (the packaged study, a hub snapshot's README,
# the fused kernel's source)
INPUTS = ("quickstart.yaml", "README.md", "fused.cpp")

# (name, "write" or "read", function): a second writer or reader the code still has, and why
NOT_YET = {
    # files.py recognizes a folder an older quantgate wrote (before folders were marked) by the shape of each
    # kind's main file, below the layers whose readers know it
    ("metrics.json", "read", Q + "files._older_study"): "an older study run, by its keys",
    ("model.json", "read", Q + "files._older_study"): "an older study run stopped before metrics.json",
    ("log.jsonl", "read", Q + "files._older_train"): "an older training run, by its first line",
    ("log.jsonl", "read", Q + "train.log.JsonLog.__init__"): "the log's writer keeps, on a resume, the lines up to "
    "the checkpoint's step (a line cut off mid-write too, which read_log refuses)",
    ("eval.json", "read", Q + "files._older_eval"): "an older quantgate eval, by its keys",
    ("eval.partial.json", "read", Q + "files._older_eval"): "the same",
    ("observe.json", "read", Q + "files.<module>"): "an older quantgate observe (files._LEGACY), by its keys",
    ("audit.json", "read", Q + "files.<module>"): "an older quantgate audit (files._LEGACY), by its keys",
    ("compare.csv", "read", Q + "files.<module>"): "an older quantgate compare (files._LEGACY), by its header",
}

# generic I/O helpers: they write or read the path their caller gives; the caller is the file's writer or reader
HELPERS = {
    Q + "files." + name
    for name in ("write_text_atomic", "write_bytes_atomic", "read_text", "read_json", "read_json_lines", "_json_object")
} | {Q + "files._first_line", Q + "plots.save_png", Q + "yaml_file.read_yaml"}
# they open a file's bytes without reading its format: a content hash, a sync to disk, a staged folder moved in place
UNREAD = {Q + "files.file_sha256", Q + "files._fsync", Q + "files.staged_dir"}

# the calls that write or read the path they are given (a file name's literal or constant reaching one of them
# makes the function a writer or a reader of that file); open() by its mode, os.open by its flags
WRITES = {"write_text_atomic", "write_bytes_atomic", "write_text", "write_bytes", "save_png", "save_file"}
WRITES |= {"FileHandler", "savefig"}
READS = {"read_json", "read_json_lines", "read_text", "read_bytes", "load_file", "safe_open", "read_safetensors"}
READS |= {"_json_object", "_first_line"}
NAME = re.compile(r"^(?!.*\*)(\.quantgate[\w.-]*|study-key|[\w][\w.-]*\.(json|jsonl|md|png|yaml|csv|safetensors|txt))$")


def kind_of(path: PurePosixPath) -> Kind | str | None:
    """The row of :data:`FILES` (or the name in :data:`OTHERS`) a file written at ``path`` is, None: neither."""
    row = next((k for k in FILES if path.match(k.path)), None)
    return row if row is not None else next((o for o in OTHERS if path.match(o)), None)


def is_of(function: str, owner: str | None) -> bool:
    """Whether ``function`` is ``owner`` or (``owner`` a class) one of its methods."""
    return owner is not None and (function == owner or function.startswith(owner + "."))


# --- 1. real runs, traced ------------------------------------------------------------------------------------------

_trace: list[tuple[str, str, str | None]] | None = None  # (kind of access, path, function) while a run is traced
_root: str = ""


def _function() -> str | None:
    """The innermost function of the package on the stack that is not a generic helper (:data:`HELPERS`); None
    inside one of :data:`UNREAD`."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(str(PACKAGE)):
            name = _named(frame.f_code.co_filename, frame.f_lineno)
            if name in UNREAD:
                return None
            if name not in HELPERS:
                return name
        frame = frame.f_back
    return None


@functools.cache
def _lines(file: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of each function of module ``file``, as part 2 names them."""
    module, tree = _module_name(Path(file)), ast.parse(Path(file).read_text())
    return [(u.lineno, u.end_lineno, f"{module}.{q}") for q, u in _units(tree) if q != "<module>"]


def _named(file: str, line: int) -> str:
    """The function of ``file`` that holds ``line`` (the innermost; a lambda is its function's), else ``<module>``."""
    holding = [(b - a, name) for a, b, name in _lines(file) if a <= line <= b]
    return min(holding)[1] if holding else f"{_module_name(Path(file))}.<module>"


def _hook(event: str, args: tuple) -> None:
    if _trace is None or event not in ("open", "os.rename", "os.replace"):
        return
    path = args[0] if event == "open" else args[1]
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.fsdecode(path).startswith(_root):
        return
    if event == "open":
        mode, flags = args[1], args[2]
        written = any(c in mode for c in "wax+") if mode else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    elif os.path.isdir(args[0]):
        return  # a folder staged whole: its files were traced as written inside it
    else:
        written = True
    _trace.append(("write" if written else "read", os.fsdecode(path), _function()))


sys.addaudithook(_hook)  # for the process: it does nothing unless a run is traced


def _where(path: str) -> PurePosixPath | None:
    """``path`` relative to the runs' folder, a folder staged before it is moved in place (``.NAME.<pid>.staged``,
    ``.NAME.tmp``) read as the folder it becomes; None for a temporary file written before its rename (the rename is
    traced as the write)."""
    *folders, name = PurePosixPath(os.path.relpath(path, _root)).parts
    if re.fullmatch(r"\..+\.\d+\.tmp", name):
        return None
    return PurePosixPath(*(re.sub(r"^\.(.+?)(\.\d+\.staged|\.tmp)$", r"\1", f) for f in folders), name)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> list[tuple[str, PurePosixPath, str | None]]:
    """Every file access of the runs: (``write`` or ``read``, path relative to their folder, function)."""
    global _trace, _root
    root = tmp_path_factory.mktemp("written")
    (root / "s.yaml").write_text(TINY_STUDY.format(name="s"))
    _root, _trace = str(root), []
    try:
        assert main(["study", str(root / "s.yaml"), "--out", str(root / "study")]) == 0
        assert main(["report", str(root / "study"), "--cluster", "document"]) == 0
        model = qg.build("tiny-llama", seed=0)
        tok = qg.tokenizer(model)
        run: dict[str, Any] = {**TINY_TRAIN, "out": str(root / "train")}
        train(model, tok, config=TrainConfig(**run, stop_after=2))  # a checkpoint at step 2, then resumed
        train(qg.build("tiny-llama", seed=0), tok, config=TrainConfig(**run, resume=True))
        qg.save(qg.build("tiny-llama", seed=0), root / "fl")
        qg.save(qg.quantize(qg.load(root / "fl"), "w8-int8"), root / "q")
        for m in ("fl", "q"):
            assert (
                main(["eval", str(root / m), "--tasks", "quantgate_ppl", "--limit", "1", "--out", f"{root}/{m}-eval"])
                == 0
            )
        assert main(["compare", str(root / "fl-eval"), str(root / "q-eval"), "--out", str(root / "cmp")]) == 0
        assert main(["observe", str(root / "fl"), "--out", str(root / "obs")]) == 0
        seen = list(_trace)
    finally:
        _trace = None
    return [(access, where, function) for access, path, function in seen if (where := _where(path)) is not None]


def test_every_file_written_is_listed(traced):
    unlisted = sorted({str(where) for access, where, _ in traced if access == "write" and kind_of(where) is None})
    assert unlisted == [], "written, and in neither FILES nor OTHERS: add its row"


def _strays_in_runs(traced) -> dict[tuple[str, str, str], str]:
    """{(file name, "write" or "read", function): a path it was seen at} of each write or read in the runs by
    another function than the file's own writer or reader."""
    out = {}
    for access, where, function in traced:
        kind = kind_of(where)
        if not isinstance(kind, Kind) or function is None:
            continue
        if is_of(function, kind.writer if access == "write" else kind.reader):
            continue
        out[kind.spelled()[0] if kind.spelled() else kind.path, access, function] = str(where)
    return out


def test_each_file_is_written_by_its_writer_and_read_by_its_reader(traced):
    strays = _strays_in_runs(traced)
    assert sorted((strays[k], *k[1:]) for k in strays if k not in NOT_YET) == []


def test_the_runs_write_the_files_of_each_command(traced):
    """The runs reach what the table says of them: each command's files, written by their writers."""
    kinds = [(access, kind_of(where)) for access, where, _ in traced]
    written = {kind.path for access, kind in kinds if access == "write" and isinstance(kind, Kind)}
    expected = {"metrics.json", "cells/*/scheme-*.json", "report.md", "eval.json", "compare.csv", "observe.json"}
    expected |= {"log.jsonl", "checkpoints/*/trainer.json", "quantization.json", ".quantgate", "study_quant.png"}
    assert expected <= written
    read = {kind.path for access, kind in kinds if access == "read" and isinstance(kind, Kind)}
    assert {"metrics.json", "eval.json", "log.jsonl", "checkpoints/*/trainer.json", "quantization.json"} <= read


# --- 2. the code, read ---------------------------------------------------------------------------------------------


def _module_name(file: Path) -> str:
    return ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _constants(modules: dict[str, ast.Module]) -> dict[str, str]:
    """Module constants bound to a file name (``LOG_FILE = "log.jsonl"``, ``MANIFEST = SIDECAR``), by name."""
    out: dict[str, str] = {}
    for _ in range(2):  # an alias of a constant defined in another module
        for tree in modules.values():
            for node in tree.body:
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(target.elts, node.value.elts, strict=True))
                    for name, value in pairs:
                        if not isinstance(name, ast.Name):
                            continue
                        if isinstance(value, ast.Constant) and isinstance(value.value, str) and NAME.match(value.value):
                            assert out.get(name.id, value.value) == value.value, f"{name.id} names two files"
                            out[name.id] = value.value
                        elif isinstance(value, ast.Name) and value.id in out:
                            out[name.id] = out[value.id]
    return out


def _units(tree: ast.Module):
    """(qualified name, node) of the module's body (``<module>``) and of each function, methods included."""

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")

    yield "<module>", tree
    yield from visit(tree, "")


def _own(unit: ast.AST) -> list[ast.AST]:
    """The nodes of ``unit`` outside the functions and classes it defines."""
    out, stack = [], list(ast.iter_child_nodes(unit))
    while stack:
        node = stack.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node)
            stack.extend(ast.iter_child_nodes(node))
    return out


def _accesses(modules: dict[str, ast.Module]) -> tuple[dict[tuple[str, str], set[str]], set[str]]:
    """{(file name, "write" or "read"): the functions that hand it to a write or a read}, and every file name
    spelled. A function hands a name on where it reaches the call's arguments (or the object a method is called
    on) directly or through the local names assigned from it."""
    constants = _constants(modules)

    def names(node: ast.AST, local: dict[str, set[str]]) -> set[str]:
        """The file names ``node`` holds: spelled in it (a literal, a constant) or held by a local name it uses."""
        found: set[str] = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.match(n.value):
                found.add(n.value)
            elif isinstance(n, (ast.Name, ast.Attribute)):
                name = n.id if isinstance(n, ast.Name) else n.attr
                found |= {constants[name]} if name in constants else local.get(name, set())
        return found

    accesses: dict[tuple[str, str], set[str]] = defaultdict(set)
    every: set[str] = set()
    for module, tree in modules.items():
        for qualname, unit in _units(tree):
            nodes = _own(unit)
            local: dict[str, set[str]] = defaultdict(set)  # local name -> the file names its value holds
            for _ in range(3):  # through a chain of assignments
                for node in nodes:
                    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                        held = names(node.value, local)
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for n in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                            local[n.id] |= held
            for node in nodes:
                if isinstance(node, (ast.Constant, ast.Name, ast.Attribute)):
                    every |= names(node, {})
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                given = [*node.args, *(k.value for k in node.keywords)]
                if isinstance(func, ast.Attribute):
                    given.append(func.value)  # the object a method is called on: (out / "observe.md").write_text
                access = _access(node, callee)
                for name in set().union(*(names(g, local) for g in given)) if access else ():
                    accesses[name, access].add(f"{module}.{qualname}")
    return accesses, every


def _access(call: ast.Call, callee: str) -> str:
    """Whether ``call`` (to ``callee``) writes or reads the path it is given: "write", "read" or ""."""
    if callee == "open" and isinstance(call.func, ast.Name):  # open(): by its mode
        modes = [*call.args[1:2], *(k.value for k in call.keywords if k.arg == "mode")]
        mode = next((str(m.value) for m in modes if isinstance(m, ast.Constant)), "r")
        return "write" if any(c in mode for c in "wax+") else "read"
    if callee == "open":  # os.open: by its flags
        flags = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)}
        return "write" if flags & {"O_CREAT", "O_WRONLY", "O_RDWR"} else "read"
    return "write" if callee in WRITES else "read" if callee in READS else ""


@pytest.fixture(scope="module")
def code():
    return _accesses(_modules())


def _strays_in_code(code) -> set[tuple[str, str, str]]:
    """(file name, "write" or "read", function) of each function that hands a name of :data:`FILES` to a write or a
    read and is not the writer or reader of a file of that name."""
    accesses, _ = code
    named: dict[str, list[Kind]] = defaultdict(list)
    for kind in FILES:
        for name in kind.spelled():
            named[name].append(kind)
    out = set()
    for (name, access), functions in accesses.items():
        owners = [k.writer if access == "write" else k.reader for k in named.get(name, [])]
        out |= {(name, access, f) for f in functions if name in named and not any(is_of(f, o) for o in owners)}
    return out


def test_the_code_writes_and_reads_each_file_in_its_one_writer_and_reader(code):
    assert sorted(_strays_in_code(code) - set(NOT_YET)) == [], "a second writer or reader: make it use the file's own"


def test_not_yet_lists_only_what_is_there(traced, code):
    gone = set(NOT_YET) - set(_strays_in_runs(traced)) - _strays_in_code(code)
    assert sorted(gone) == [], "no longer there: take it out of NOT_YET"


def test_every_file_name_the_package_spells_is_in_a_table(code):
    _, every = code
    listed = {name for kind in FILES for name in kind.spelled()} | set(OTHERS) | set(INPUTS)
    assert sorted(every - listed) == []
