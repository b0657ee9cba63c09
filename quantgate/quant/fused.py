"""Fused CPU kernels for the hot per-tensor work of simulated quantization and observe, compiled on the machine at
hand.

The eager quantizers make six to ten full passes over a tensor (a float32 copy, scale, round, clamp, rescale, the
cast back; FP8/FP4 add the step bits of :func:`.minifloat.round_`) and a per-token range two more, plus a dozen tiny
ops on the scales; observe's statistics of one tensor take about twenty. ``fused.cpp`` does each in one or two
passes with the same float32 operations in the same order:

* :func:`fake_int` (static grids: one scale, one per row, one per channel) and :func:`fake_int_rows` (dynamic per
  token: range, torchao's scale and zero point, round trip in one call), :func:`fake_minifloat` (FP8 E4M3/E5M2,
  FP4 E2M1, with the saturated count), :func:`fake_mx` (MXFP8/MXFP4) and :func:`fake_nvfp4`: bit-identical to the
  eager reference;
* :func:`tensor_stats` and :func:`log_bins` (observe): maxima, positions, channels and histogram counts identical;
  the centred moments summed in float64 (the eager path sums each token's in float32 first), within 2e-7 relative.

tests/test_fused.py holds every kernel to the eager reference on random and outlier-heavy inputs in float32 and
bfloat16 (ties, zeros, subnormals, saturation, NaN and inf), which stays the reference and the fallback.

Built once per (source, torch version, CPU flags, compiler flags) with torch's C++ extension tooling (g++ and
ninja) into ``$QUANTGATE_CACHE/ext/`` and loaded from there by later processes (about 0.2 s); the cold build
takes about 40 s of one core. Each build runs in a folder of its own and its library is moved into place when
complete, so a build killed midway leaves no lock behind. ``QUANTGATE_COMPILE=0``, no compiler, or a failed
build: the eager path, with one log line saying why. The kernels serve CPU tensors of float32, bfloat16 or
float16 outside autograd; anything else (CUDA tensors included: there the eager ops run as device kernels) takes
the eager path.

Why a C++ extension and not ``torch.compile``: compiled whole functions were 1.2-3x eager against 3-10x for the
extension, took 10-27 s per graph and shape, and inductor's reductions are not bit-identical
(../shared/PERF-PROBE.md); benchmarks/speed.py measures the extension end to end here.
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

from .minifloat import MINIFLOATS, MX_MAX_POW2

__all__ = [
    "kernels",
    "minmax_rows",
    "fake_int",
    "fake_int_rows",
    "fake_minifloat",
    "fake_mx",
    "fake_nvfp4",
    "log_bins",
    "tensor_stats",
    "eager",
    "forced_eager",
    "status",
]

log = logging.getLogger("quantgate")
SOURCE = Path(__file__).with_name("fused.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: each op rounds as torch's
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
    if forced_eager():
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
    """Run the eager reference in this thread while inside, as it ran before the fused path: no kernels, and each
    activation quantizer computes its own values (:class:`.simulate.ActQuant` shares none); benchmarks and tests
    set the two side by side."""
    was = getattr(_local, "eager", False)
    _local.eager = True
    try:
        yield
    finally:
        _local.eager = was


def forced_eager() -> bool:
    """Whether :func:`eager` is in force in this thread."""
    return getattr(_local, "eager", False)


def _servable(x: torch.Tensor) -> bool:
    grad = x.requires_grad and torch.is_grad_enabled()
    return x.device.type == "cpu" and x.dtype in DTYPES and x.dim() >= 1 and not grad


def _served(x: torch.Tensor) -> ModuleType | None:
    return kernels() if _servable(x) and x.numel() else None


def minmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's (last dim's) min and max, shaped ``x.shape[:-1] + (1,)`` in ``x``'s dtype (what
    ``x.amin(-1, keepdim=True)`` and ``x.amax(...)`` give); None where the eager path must run."""
    k = _served(x)
    if k is None:
        return None
    lo, hi = k.minmax_rows(x.detach().contiguous())
    return lo, hi


def _mode(x: torch.Tensor, scale: torch.Tensor) -> int | None:
    """How ``scale`` spans ``x``: 0 one value, 1 one per row of the last dim (shape ``x.shape[:-1] + (1,)``, any
    leading ones aside), 2 one per channel of the last dim; None for any other broadcast (the eager path)."""
    n = x.shape[-1]
    if scale.numel() == 1:
        return 0
    if scale.shape == (*x.shape[:-1], 1):
        return 1
    if scale.numel() == n and scale.shape[-1] == n and all(d == 1 for d in scale.shape[:-1]):
        return 2
    return None


def fake_int(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor | None:
    """The integer round trip of :func:`.quantizers.fake_int_reference` in one pass (``scale`` and ``zero`` as it
    takes them: one value, one per row of the last dim, or one per channel of it; taken to float32, the zero point
    rounded, as it does); None where the eager path must run."""
    k = _served(x)
    mode = None if k is None else _mode(x, scale)
    if k is None or mode is None:
        return None
    scale, zero = scale.float(), torch.round(zero.float())
    if zero.numel() != scale.numel():
        zero = zero.expand(scale.shape)
    flat = [t.reshape(-1).contiguous() for t in (scale, scale.reciprocal(), zero)]
    return k.fake_int(x.detach().contiguous(), *flat, qmin, qmax, mode)


def fake_int_rows(x: torch.Tensor, qmin: int, qmax: int, symmetric: bool, eps: float) -> torch.Tensor | None:
    """Dynamic per-token integer fake quantization in one call: each row's (last dim's) range, its scale and zero
    point by :func:`.quantizers.int_qparams`'s formula (torchao's, scales at least ``eps``) and the round trip of
    :func:`.quantizers.fake_int_reference`, in ``x``'s dtype; None where the eager path must run."""
    k = _served(x)
    return None if k is None else k.fake_int_rows(x.detach().contiguous(), qmin, qmax, symmetric, eps)


def fake_minifloat(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int] | None:
    """:func:`.minifloat.fake_minifloat`'s round trip in one pass, in ``x``'s dtype (its float32 values rounded, as
    :func:`.quantizers.fake_fp8` gives them), with the saturated count; ``scale`` float32 as it takes it. None where
    the eager path must run, and for FP4 where ``x`` holds NaN or inf or a scale is not finite and positive (the
    eager path hands those to torchao)."""
    k = _served(x)
    mode = None if k is None else _mode(x, scale)
    if k is None or mode is None:
        return None
    f = MINIFLOATS[fmt]
    flat = scale.float().reshape(-1).contiguous()
    y, saturated, special = k.fake_minifloat(x.detach().contiguous(), flat, f.mbits, f.emin, f.fmax, mode)
    if fmt == "fp4-e2m1" and (special or not bool(((flat > 0) & flat.isfinite()).all())):
        return None
    return y, saturated


def fake_mx(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor | None:
    """:func:`.minifloat.fake_mx`'s round trip (element format ``fmt``, blocks of ``block`` along the last dim, which
    ``block`` divides) in one pass, in ``x``'s dtype; None where the eager path must run."""
    k = _served(x)
    if k is None:
        return None
    f = MINIFLOATS[fmt]
    return k.fake_mx(x.detach().contiguous(), f.mbits, f.emin, f.fmax, MX_MAX_POW2[fmt], block)


def fake_nvfp4(x: torch.Tensor) -> torch.Tensor | None:
    """:func:`.minifloat.nvfp4`'s values (one per-tensor scale over all of ``x``, blocks of 16 along its last dim,
    which 16 divides) in two passes, in ``x``'s dtype; None where the eager path must run, and where a scale is not
    finite (the eager path hands those tensors to torchao)."""
    k = _served(x)
    if k is None:
        return None
    return k.fake_nvfp4(x.detach().contiguous())  # None for the undefined tensor of a scale that is not finite


def log_bins(logs: torch.Tensor, lo: float, span: float, top: float, bins: int) -> torch.Tensor | None:
    """observe's histogram counts (float64, (bins,)) of float32 log10 values ``logs`` (>= lo): each clamped to at
    most ``top``, binned by truncating ((v - lo) * bins) / span in float32, at most the last bin, as
    :func:`..observe._histogram`'s torch ops do; None where the eager path must run."""
    k = _served(logs)
    if k is None or logs.dtype != torch.float32:
        return None
    return k.log_bins(logs.contiguous(), lo, span, top, bins)


def tensor_stats(x: torch.Tensor) -> list[torch.Tensor] | None:
    """observe's statistics of an unpadded (b, t, c) tensor in two passes (:meth:`.TensorStats._whole_eager`'s
    list): each sequence's largest |x| (float32, (b,)) and its first token position (int64, (b,)), how often each
    channel holds a token's largest |x| (int64, (c,)), each channel's largest |x| (float32, (c,)), each sequence's
    centred second and fourth moments (float64, (b,)). The maxima, positions and counts are the eager path's
    exactly; the moments sum the same float32 terms in float64 (the eager path sums each token's in float32
    first), within about 2e-7 of it relative. None where the eager path must run, and where ``x`` holds NaN or
    inf."""
    k = _served(x)
    if k is None or x.dim() != 3:
        return None
    out = k.tensor_stats(x.detach().contiguous())
    return out or None
