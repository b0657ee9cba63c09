"""Fused CPU kernels for the hot per-tensor quantizer work, compiled on the machine at hand.

The eager integer fake-quantizer (:func:`.quantizers.fake_int_reference`) makes six full passes over a float32
tensor and eight over a bfloat16 one, and a per-token range two more; ``fused.cpp`` does the round trip in one
pass and the per-row min and max in one, with the same float32 operations in the same order: its results are
bit-identical to the eager reference (tests/test_fused.py holds them to it on random and outlier-heavy inputs in
both dtypes), which stays the reference and the fallback.

Built once per (source, torch version, CPU flags, compiler flags) with torch's C++ extension tooling (g++ and
ninja) into ``$QUANTGATE_CACHE/ext/`` and loaded from there by later processes (about 0.2 s); the cold build
takes about 40 s of one core. Each build runs in a folder of its own and its library is moved into place when
complete, so a build killed midway leaves no lock behind. ``QUANTGATE_COMPILE=0``, no compiler, or a failed
build: the eager path, with one log line saying why. The kernels serve CPU tensors of float32, bfloat16 or
float16 outside autograd; anything else takes the eager path.

Why a C++ extension and not ``torch.compile``: compiled whole functions were 1.2-3x eager against 3-10x for the
extension, took 10-27 s per graph and shape, and inductor's reductions are not bit-identical
(../shared/PERF-PROBE.md; benchmarks/fused_speed.py measures the extension here).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["kernels", "minmax_rows", "fake_int", "eager", "status"]

log = logging.getLogger("quantgate")
SOURCE = Path(__file__).with_name("fused.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_loaded: ModuleType | None = None
_why_not: str | None = None  # why the eager path runs (set once the build was tried or refused)
_local = threading.local()  # .eager: the eager path forced in this thread (:func:`eager`)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _key() -> str:
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(), " ".join(CFLAGS).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def _ext_dir() -> Path:
    return Path(os.environ.get("QUANTGATE_CACHE", Path.home() / ".cache" / "quantgate")) / "ext"


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, library: Path) -> ModuleType:
    """Compile in a folder of this process's own, then move the library into place."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-build-", dir=library.parent))
    try:
        module = cpp_extension.load(
            name, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(work)
        )
        built = work / f"{name}.so"
        if built.is_file() and not library.is_symlink():
            staged = library.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(built, staged)
            os.replace(staged, library)
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)


def kernels() -> ModuleType | None:
    """The compiled kernels, built or loaded on first use; None where the eager path runs (:func:`status`)."""
    global _loaded, _why_not
    if getattr(_local, "eager", False):
        return None
    if _loaded is not None or _why_not is not None:
        return _loaded
    with _lock:
        if _loaded is not None or _why_not is not None:
            return _loaded
        if os.environ.get("QUANTGATE_COMPILE", "1") == "0":
            _why_not = "QUANTGATE_COMPILE=0"
            return None
        name = f"quantgate_fused_{_key()}"
        library = _ext_dir() / f"{name}.so"
        try:
            _loaded = _import(name, library) if library.is_file() else _build(name, library)
        except Exception as e:  # no compiler, no ninja, a failed build: the eager path, said once
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _why_not = f"the fused quantizer kernels could not be built ({first[:200]})"
            log.warning("quantgate: %s; quantizing on the eager path (QUANTGATE_COMPILE=0 silences this)", _why_not)
        return _loaded


def status() -> str:
    """One line: whether the fused kernels serve, and why not where they do not."""
    kernels()
    return "fused (C++)" if _loaded is not None else f"eager ({_why_not or 'forced'})"


@contextmanager
def eager() -> Iterator[None]:
    """Run the eager reference in this thread while inside (benchmarks and tests set the two side by side)."""
    was = getattr(_local, "eager", False)
    _local.eager = True
    try:
        yield
    finally:
        _local.eager = was


def _servable(x: torch.Tensor) -> bool:
    grad = x.requires_grad and torch.is_grad_enabled()
    return x.device.type == "cpu" and x.dtype in DTYPES and x.dim() >= 1 and not grad


def minmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's (last dim's) min and max, shaped ``x.shape[:-1] + (1,)`` in ``x``'s dtype (what
    ``x.amin(-1, keepdim=True)`` and ``x.amax(...)`` give); None where the eager path must run."""
    k = kernels() if _servable(x) and x.numel() else None
    if k is None:
        return None
    lo, hi = k.minmax_rows(x.detach().contiguous())
    return lo, hi


def fake_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor | None:
    """The integer round trip of :func:`.quantizers.fake_int_reference` in one pass (``scale`` and ``zero`` as it
    takes them: one value, one per row of the last dim, or one per channel of it; taken to float32, the zero point
    rounded, as it does); None where the eager path must run."""
    k = kernels() if _servable(x) and x.numel() else None
    if k is None:
        return None
    scale, zero = scale.float(), torch.round(zero.float())
    n = x.shape[-1]
    if scale.numel() == 1:
        mode = 0
    elif scale.shape == (*x.shape[:-1], 1):
        mode = 1
    elif scale.numel() == n and scale.shape[-1] == n and all(d == 1 for d in scale.shape[:-1]):
        mode = 2
    else:
        return None
    if zero.numel() != scale.numel():
        zero = zero.expand(scale.shape)
    flat = [t.reshape(-1).contiguous() for t in (scale, scale.reciprocal(), zero)]
    return k.fake_int(x.detach().contiguous(), *flat, qmin, qmax, mode)
