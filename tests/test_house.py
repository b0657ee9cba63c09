"""The package's shape (issue 45): no import cycle between its modules, no long function outside the kernels, and
every refusal a QuantgateError (quantgate.errors) that the command line prints as one line."""

import ast
import sys
from pathlib import Path

import pytest

import quantgate as qg
from quantgate.errors import InputError, MissingDependency, MissingFile, QuantgateError, Unavailable

PACKAGE = Path(qg.__file__).resolve().parent
MAX_LINES = 80
KERNELS = {"attention/triton_sdpa.py"}  # a Triton kernel is one function by nature


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_module_string(name: str, path: Path, node: ast.Call) -> str | None:
    """The module an ``importlib.import_module("...")`` call names by a literal string (relative ones resolved
    against the calling module's package), else None."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if called != "import_module" or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    target = node.args[0].value
    if not isinstance(target, str):
        return None
    dots = len(target) - len(target.lstrip("."))
    if not dots:
        return target
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    rest = target[dots:]
    return ".".join(package[: len(package) - dots + 1] + ([rest] if rest else []))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere (top level, in functions, under TYPE_CHECKING, by an
    ``importlib.import_module`` string): for ``from P import x``, the submodule P.x where x is one, else P."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and (target := _import_module_string(name, path, node)) is not None:
            found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_the_packages_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(len(v) for v in graph.values()) > 300  # the graph was read (measured: ~600 edges)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_follows_import_module_strings(tmp_path):
    """An upward import by string (``importlib.import_module("quantgate.x")``) is an edge like any other."""
    modules = dict.fromkeys(("quantgate.a", "quantgate.b", "quantgate.c", "quantgate.d"), tmp_path / "x.py")
    source = tmp_path / "b.py"
    source.write_text(
        "import importlib\nfrom importlib import import_module\n"
        "def f():\n    importlib.import_module('quantgate.a')\n    import_module('.c', __name__)\n"
        "    importlib.import_module(f'quantgate.{f}')\n"
    )
    assert _imports("quantgate.b", source, modules) == {"quantgate.a", "quantgate.c"}


def _long_functions() -> dict[str, int]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in KERNELS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found[f"{rel}:{node.name}"] = lines
    return found


def test_no_function_over_80_lines_outside_the_kernels():
    assert _long_functions() == {}


def test_the_length_check_finds_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert _long_functions() == {"long.py:long": MAX_LINES + 1}


def _raised_builtins() -> list[str]:
    """``raise ValueError(...)`` (and FileNotFoundError, ModuleNotFoundError, RuntimeError) in the package: a
    refusal that a caller cannot tell from a bug. (A TypeError stays one: a programming error, as an extension's
    scheme class without a handler.)"""
    builtin = {"ValueError", "FileNotFoundError", "ModuleNotFoundError", "RuntimeError"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # raised, or made to be raised later
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in builtin:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.func.id}")
    return found


def test_the_package_raises_its_own_refusals():
    assert _raised_builtins() == []


def test_each_refusal_class_is_a_quantgate_error_and_the_builtin_it_replaced():
    for cls, builtin in (
        (InputError, ValueError),
        (MissingFile, FileNotFoundError),
        (MissingDependency, ModuleNotFoundError),
        (Unavailable, RuntimeError),
    ):
        assert issubclass(cls, QuantgateError) and issubclass(cls, builtin)
    from quantgate.audit import AuditError
    from quantgate.data.corpus import OfflineError
    from quantgate.quant import HardwareUnavailable
    from quantgate.study.schema import StudyError
    from quantgate.train import TrainingDiverged

    assert all(issubclass(c, InputError) for c in (StudyError, AuditError))
    assert all(issubclass(c, Unavailable) for c in (HardwareUnavailable, TrainingDiverged))
    assert issubclass(OfflineError, QuantgateError) and issubclass(OfflineError, ConnectionError)


@pytest.mark.parametrize(
    ("call", "cls", "words"),
    [
        (lambda: qg.build("tiny-llama", variant="g9-nowhere"), InputError, "g9-nowhere"),
        (lambda: qg.quantize(qg.build("tiny-llama", seed=0), "w8a8-no-such"), InputError, "w8a8-no-such"),
        (lambda: qg.load("/nonexistent/quantgate-model"), QuantgateError, "/nonexistent/quantgate-model"),
    ],
    ids=["unknown variant", "unknown scheme", "missing checkpoint"],
)
def test_a_callers_except_catches_a_refusal_by_type(call, cls, words):
    with pytest.raises(cls, match=words):
        call()


def test_the_command_line_prints_a_refusal_in_one_line_and_a_bug_with_its_traceback(monkeypatch, capsys, tmp_path):
    from quantgate import cli

    assert cli.main(["observe", "tiny-llama", "--variant", "g9-nowhere", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quantgate observe: error: ") and "g9-nowhere" in err[0]

    def bug(*args, **kwargs):
        raise ValueError("a bug, not a refusal")

    monkeypatch.setattr(cli, "_load_or_build", bug)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["observe", "tiny-llama", "--out", str(tmp_path / "b")])


def test_qg_names_the_verbs_and_the_refusals():
    for name in ("train", "TrainConfig", "run_study", "Evaluation", "QuantgateError", "InputError"):
        assert name in qg.__all__ and getattr(qg, name) is not None
    assert callable(qg.train) and callable(qg.run_study)
    assert "quantgate.train.loop" in sys.modules  # the package's modules stay importable by name


TOY_BACKEND = '''
"""A toy backend, all in this one module: weights rounded to bfloat16, its models saved in quantgate's format
unless EXPORTS names its own, "toy" (the rounded weights stored in bfloat16, with a transformers-style
quantization config naming the Linears kept), which it reads back; its state names the Linears it rounded."""
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantgate.json_record import JsonRecord
from quantgate.quant.formats import BackendState, Format, Written
from quantgate.quant.schemes import SCHEMES, Scheme, handles
from quantgate.quant.sites import kept_linears, quantizable_linears

EXPORTS = {"format": "quantgate"}


@dataclass(frozen=True)
class ToyScheme(Scheme):
    options: ClassVar[tuple[str, ...]] = ("keep", "gates")


@dataclass(frozen=True)
class ToyState(BackendState):
    rounded: list[str]  # the Linears rounded to bfloat16

    @classmethod
    def of(cls, model):
        return cls(sorted(n for n, m in model.named_modules() if getattr(m, "toy_rounded", False)))


@dataclass(frozen=True)
class ToyFormatState(JsonRecord):
    stored: list[str]  # the tensors stored in bfloat16


def restore(model, scheme, manifest):
    for name in manifest.state.rounded:  # the backend's own state, typed
        model.get_submodule(name).toy_rounded = True
    return model


def export(model, scheme):
    fmt = EXPORTS["format"]
    return (fmt, "the toy's rounding is its own") if fmt == "quantgate" else (fmt, "")


def write(model, scheme, dtype):
    rounded = {f"{n}.weight" for n in ToyState.of(model).rounded}
    tensors = {k: v.to(torch.bfloat16) if k in rounded else v for k, v in model.state_dict().items()}
    return Written(tensors, {"toy": kept_linears(model, scheme)}, ToyFormatState(sorted(rounded)))


def read(model, scheme, tensors, state):
    return {k: v.float() if k in state.stored else v for k, v in tensors.items()}


TOY = Format("toy", write=write, read=read, state=ToyFormatState)


@handles(ToyScheme, restore=restore, export=export, formats=(TOY,), state=ToyState)
def apply(model, scheme, calibrate):
    with torch.no_grad():
        for _, linear in quantizable_linears(model, scheme):
            linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
            linear.toy_rounded = True
    return model


SCHEMES.add("w16-toy", ToyScheme("w16-toy", "weights rounded to bfloat16"))
'''


@pytest.fixture
def toy_backend(tmp_path, monkeypatch, registries):
    """The toy backend's module, imported from a temporary folder; the registries it fills restored after."""
    import importlib

    from quantgate.quant import schemes

    (tmp_path / "toy_backend.py").write_text(TOY_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    registries(schemes.SCHEMES, schemes.HANDLERS)
    monkeypatch.delitem(sys.modules, "toy_backend", raising=False)
    return importlib.import_module("toy_backend")


def test_a_new_backend_is_a_scheme_class_and_one_handler_module(toy_backend, tmp_path):
    """A scheme class and its handler in one module (no other file touched): it quantizes, saves in the format its
    handler names (quantgate's own, with why), loads back to the same logits, and, where the handler names its own
    format, writes it (the format's quantization config and state, the backend's state) and loads it back to the
    same logits."""
    import json

    import safetensors.torch
    import torch

    from quantgate.quant.export import export_format

    model = qg.build("tiny-llama", seed=0).eval()
    q = qg.quantize(model, "w16-toy:keep=model.layers.1*")
    record = qg.quantization_of(q)
    assert record is not None and record.scheme == "w16-toy:keep=model.layers.1*"
    rounded, kept = (q.get_parameter(f"model.layers.{i}.mlp.up_proj.weight") for i in (0, 1))
    assert torch.equal(rounded, rounded.to(torch.bfloat16).float())
    assert not torch.equal(rounded, model.get_parameter("model.layers.0.mlp.up_proj.weight"))  # it did round
    assert torch.equal(kept, model.get_parameter("model.layers.1.mlp.up_proj.weight"))  # kept
    assert export_format(q, toy_backend.SCHEMES["w16-toy"]) == ("quantgate", "the toy's rounding is its own")
    qg.save(q, tmp_path / "q")
    again = qg.load(tmp_path / "q")
    ids = torch.randint(5, 200, (2, 16))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)
    toy_backend.EXPORTS["format"] = "toy"  # the backend's own format, which it writes and reads back
    qg.save(q, tmp_path / "q2")
    config = json.loads((tmp_path / "q2" / "config.json").read_text())
    kept_linears = config["quantization_config"]["toy"]  # the format's config, given the Linears kept in float
    assert "lm_head" in kept_linears and "model.layers.1.mlp.up_proj" in kept_linears
    assert not [n for n in kept_linears if n.startswith("model.layers.0.")]
    manifest = json.loads((tmp_path / "q2" / "quantization.json").read_text())
    assert manifest["format"] == "toy" and "model.layers.0.mlp.up_proj" in manifest["state"]["rounded"]
    assert "model.layers.0.mlp.up_proj.weight" in manifest["format_state"]["stored"]
    assert not any(n.startswith("model.layers.1.") for n in manifest["state"]["rounded"])
    stored = safetensors.torch.load_file(tmp_path / "q2" / "model.safetensors")
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    again = qg.load(tmp_path / "q2")
    assert again.get_submodule("model.layers.0.mlp.up_proj").toy_rounded  # restored from the backend's state
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)
