"""Every public function of the package states its types: a parameter or return without an annotation fails.

Public: a module-level function or a method of a public class, whose name has no leading underscore, in a
module whose name has none. (mypy, run by .ci/run before the tests, then checks their bodies.)
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quantgate"


def _unannotated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    out = [
        x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.annotation is None and x.arg not in ("self", "cls")
    ]
    out += [f"*{x.arg}" for x in (a.vararg, a.kwarg) if x is not None and x.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        out.append("return")
    return out


def _public_functions(body: list[ast.stmt], prefix: str = ""):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _public_functions(node.body, f"{prefix}{node.name}.")


def unannotated_public_functions(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name.startswith("_") and path.name != "__init__.py":
            continue
        for name, fn in _public_functions(ast.parse(path.read_text()).body):
            if missing := _unannotated(fn):
                found.append(f"{path.relative_to(package.parent)}:{fn.lineno} {name}: {', '.join(missing)}")
    return found


def test_the_checker_finds_a_missing_annotation(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(x: int) -> int: ...\ndef g(x, *, y: int) -> None: ...\ndef _h(x): ...\n"
        "class C:\n    def m(self, a: int): ...\n    def __init__(self, b: int): ...\n"
    )
    assert unannotated_public_functions(tmp_path) == [
        f"{tmp_path.name}/m.py:2 g: x",
        f"{tmp_path.name}/m.py:5 C.m: return",
    ]


def test_public_functions_are_annotated():
    missing = unannotated_public_functions()
    assert not missing, "annotate these public functions:\n" + "\n".join(missing)
