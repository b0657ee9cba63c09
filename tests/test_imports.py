"""quantgate without its heavy optional dependencies (a GPU image with torch, triton and transformers only):
models, gated_sdpa, the simulated schemes and serial studies work; lm-eval, torchao and Ray features name what
to install."""

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]  # mypy checks as 3.10; absent on 3.11+

ROOT = Path(__file__).resolve().parents[1]
# distributions whose import name is not their normalized name
IMPORT_NAMES = {"pyyaml": "yaml"}

SCRIPT = textwrap.dedent("""
    import sys
    for name in ("lm_eval", "torchao", "bitsandbytes", "ray"):
        sys.modules[name] = None  # any import of these now fails, as where they are not installed

    import pytest
    import torch
    import quantgate as qg

    ids = torch.randint(5, 1000, (2, 12))
    m = qg.build("tiny-llama", "g1-headwise")
    with torch.no_grad():
        assert m(ids).logits.shape == (2, 12, m.config.vocab_size)

    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    gate = torch.rand(1, 2, 8, 1)
    by_hand = torch.softmax(q @ k.transpose(-1, -2) / 16 ** 0.5, -1) @ v * gate
    torch.testing.assert_close(qg.gated_sdpa(q, k, v, gate), by_hand, atol=1e-5, rtol=1e-5)

    calib = [{"input_ids": ids}]
    for scheme in ("w8a8-int8-static", "w8a8-int8-dynamic", "w8a8-fp8-e4m3", "w8-int8"):
        with torch.no_grad():
            assert torch.isfinite(qg.quantize(m, scheme, calibration=calib)(ids).logits).all()
    with pytest.raises(ModuleNotFoundError, match=r"needs torchao \\(pip install"):
        qg.quantize(m, "torchao-int8-dynamic")
    with pytest.raises(ModuleNotFoundError, match=r"needs bitsandbytes \\(pip install"):
        qg.quantize(m, "llm-int8")
    with pytest.raises(ModuleNotFoundError, match=r"needs lm-eval \\(pip install lm-eval==0.4.13"):
        qg.evaluate(m, tasks=["quantgate_ppl"], limit=1)
    assert "perplexity" in qg.evaluate(m, tasks=["quantgate_backcopy"], limit=1).results["quantgate_backcopy"]
    from quantgate.study.executors import run_cells
    assert run_cells([], None, None, "serial") == []  # serial studies need no Ray
    with pytest.raises(ModuleNotFoundError, match=r"the ray executor needs Ray \\(pip install 'ray>=2.60,<3'"):
        run_cells([], None, None, "ray")
    print("ok")
""")


def test_quantgate_works_without_lm_eval_torchao_bitsandbytes_and_ray():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_every_pinned_dependency_and_test_extra_imports():
    """Each package pyproject.toml pins in [project] dependencies and the ``test`` extra imports here: a missing
    one fails this test instead of silently skipping the tests that need it (stub-only packages are not
    importable and are left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    names = {
        r.name.lower(): IMPORT_NAMES.get(r.name.lower(), r.name.lower().replace("-", "_"))
        for r in requirements
        if not r.name.lower().startswith("types-") and (r.marker is None or r.marker.evaluate())
    }
    assert {"torch", "transformers", "yaml", "pytest"} <= set(names.values())  # the lists were read
    missing = {}
    for dist, module in names.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # a broken install (not only a missing one) fails too
            missing[dist] = f"import {module}: {type(e).__name__}: {e}"
    assert not missing, "pinned in pyproject.toml but not importable:\n" + "\n".join(missing.values())


def _imported_modules(statement: str) -> list[str]:
    """The modules ``python -X importtime -c statement`` imports, by name, from a fresh interpreter."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    return [name for name in rows[1:] if name]  # rows[0] is the header (self [us] | cumulative | imported package)


def test_importing_one_module_loads_neither_the_audit_nor_transformers_nor_lm_eval():
    """qg.* names resolve at first use, so ``import quantgate.options`` loads that module and what it imports:
    no audit, no torch model code, no lm-eval (measured: about 120 modules against 3,600 when the package's
    __init__ imported everything)."""
    modules = _imported_modules("import quantgate.options")
    assert "quantgate.options" in modules and "quantgate.errors" in modules  # the list was read
    heavy = ("quantgate.audit", "quantgate.models", "quantgate.quant", "transformers", "lm_eval", "torch")
    loaded = [m for m in modules if m in heavy or m.startswith(tuple(f"{h}." for h in heavy))]
    assert loaded == []
    assert len(modules) < 400


def test_every_qg_name_resolves_and_dir_lists_the_api():
    run = subprocess.run([sys.executable, "-c", QG_NAMES], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"


QG_NAMES = textwrap.dedent("""
    import importlib
    import types
    import quantgate as qg
    import quantgate.observe, quantgate.train, quantgate.eval.evaluate, quantgate.audit  # the submodules first
    assert set(qg.__all__) <= set(dir(qg))
    for name in qg.__all__:
        assert getattr(qg, name) is not None, name
    for verb in ("observe", "train", "evaluate", "audit"):  # still the verbs, not their submodules
        assert callable(getattr(qg, verb)) and not isinstance(getattr(qg, verb), types.ModuleType), verb
    for verb in ("observe", "train", "audit"):  # a verb's submodule named as it
        assert isinstance(importlib.import_module(f"quantgate.{verb}"), types.ModuleType)
    assert qg.quant.SCHEMES is qg.SCHEMES and isinstance(qg.models, types.ModuleType)
    from quantgate import build, data, load, save  # noqa: F401
    try:
        qg.no_such_name
    except AttributeError:
        print("ok")
""")
