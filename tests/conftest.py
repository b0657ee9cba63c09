import contextlib
import os

# Triton kernels run on the CPU through the interpreter; triton reads this when it is first imported
# (torch and torchao may import it early), so it is set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _warm_quantgate import Warm, comparable

_warm: list[Warm | None] = []  # the servers run_python started, the last in use (None: it could not start)
_STARTS = 5  # servers run_python may start in one session, one per environment it meets; then it runs cold


def warm_tests() -> bool:
    """Whether the tests' subprocesses may fork from a warm interpreter (tests/_warm_quantgate.py); not with
    QUANTGATE_TESTS_COLD=1 (to tell a test's failure from the warm machinery's)."""
    return os.environ.get("QUANTGATE_TESTS_COLD") != "1"


def warm_python() -> Warm | None:
    """The warm interpreter for run_python, started with this process's environment at the first call and again
    where that environment has changed since (libraries the tests import set variables: ray, tokenizers), at most
    _STARTS times; None: cold."""
    if not warm_tests():
        return None
    server = _warm[-1] if _warm else None
    if _warm and (server is None or server.started_in == comparable(dict(os.environ)) or len(_warm) == _STARTS):
        return server
    if server is not None:
        server.stop()
    started = Warm(Path(tempfile.mkdtemp(prefix="quantgate-warm-")))  # in the environment a subprocess gets
    _warm.append(started if started.start() else None)
    return _warm[-1]


def run_python(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], **kwargs)`` (a script, ``-m MODULE`` or ``-c SOURCE``), the process
    forked from a warm interpreter that imported quantgate already (tests/_warm_quantgate.py): the same run, less
    the seconds of imports. Cold (a plain subprocess) where the server cannot start, for an ``env=`` other than the
    session's, or where :func:`warm_tests` says not."""
    server = warm_python()
    return subprocess.run(server.python(args) if server else [sys.executable, *args], **kwargs)


def pytest_sessionfinish(session, exitstatus):
    for server in _warm:
        if server is not None:
            server.stop()
            shutil.rmtree(server.folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def registries():
    """``registries(*tables)``: a test adds to these quantgate registries (``quantgate.registry.Registry``) and
    each is put back as it was after the test; returns the first table."""
    with contextlib.ExitStack() as stack:

        def snapshot(*tables):
            for table in tables:
                stack.enter_context(table.snapshot())
            return tables[0]

        yield snapshot


# a training run of a few seconds (tiny-llama): the settings the training tests share
TINY_TRAIN = {
    "batch_size": 2,
    "seq_len": 16,
    "lr": 3e-3,
    "eval_data": None,
    "log_every": 100,
    "seed": 3,
    "steps": 4,
    "checkpoint_every": 2,
}

# a study of seconds on an untrained tiny-llama, named by .format(name=...)
TINY_STUDY = """name: {name}
models:
  - name: m
    preset: tiny-llama
schemes: [w8-int8]
calibration: {{batches: 1, seq_len: 32, batch_size: 2}}
observe: {{batches: 1, seq_len: 32, batch_size: 2}}
eval: {{tasks: [quantgate_ppl], limit: 1}}
"""


def snapshot_files(folder: Path) -> dict[str, bytes | str]:
    """Every file and link under ``folder`` (links not followed), with its bytes or its target: what a refused
    command must leave as it was."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = str(p.readlink())
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    """An untrained tiny-llama saved by qg.save (a float checkpoint), one per test module."""
    import quantgate as qg

    path = tmp_path_factory.mktemp("fl") / "fl"
    qg.save(qg.build("tiny-llama", seed=0), path)
    return path


@pytest.fixture(scope="module")
def study_run(tmp_path_factory) -> tuple[Path, Path]:
    """TINY_STUDY's study file and a finished run of it, one per test module (copy it to change it)."""
    from quantgate.cli import main

    root = tmp_path_factory.mktemp("study")
    study = root / "base.yaml"
    study.write_text(TINY_STUDY.format(name="base"))
    assert main(["study", str(study), "--out", str(root / "run")]) == 0
    return study, root / "run"


def load_script(path, name: str):
    """A repository script (scripts/, benchmarks/) imported as module ``name``, for tests of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line_error(capsys, command: str) -> str:
    """The command's error: stderr's last line (progress bars may come before it), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"quantgate {command}: error: ")
    return line


FAMILY_PRESETS = ["tiny-bert", "tiny-opt", "tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mla"]


def build_or_refuse(preset, variant, **kw):
    """qg.build, except where the family cannot express the variant (MLA and G2): then the refusal is
    checked and None returned."""
    import quantgate as qg

    if preset == "tiny-mla" and "g2-value" in variant:
        with pytest.raises(ValueError, match="g2-value gates each key token's values"):
            qg.build(preset, variant, **kw)
        return None
    return qg.build(preset, variant, **kw)


GATED = [
    "g1-elementwise",
    "g1-headwise",
    "g1-headshared",
    "g1-constant",
    "g1-ns-sigmoid",
    "g2-value",
    "g5-output",
    "bondarenko",
    "bondarenko:mode=mlp",
    "bondarenko:mode=all-heads",
    "hyga",
    "hyga:low_rank=4,fusion=product,c_gate=false",
]
ALL_VARIANTS = [
    "vanilla",
    "clipped",
    "clipped:alpha=2",
    "sink",
    *GATED,
    "g1-headwise+clipped+sink",
    "hyga:low_rank=4+sink",
]
