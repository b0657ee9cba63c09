"""Named quantization schemes, with options in the variant grammar: ``name[:key=value,...]``.

``w8a8-int8-static:w_granularity=channel,estimator=percentile,percentile=99.99,acts=bondarenko,a_bits=6``
starts from the named scheme and changes what the options say; ``str(scheme)`` prints it back.
Bondarenko et al.'s OPT protocol (their validate_clm.py and README command) is
``w8a8-int8-bondarenko:w_estimator=mse,estimator=running-percentile,percentile=99.999``; ``calib_skip=1``
leaves each sequence's first position (BOS, in quantgate's batches; the reference packs text with none)
out of the static activation ranges.
``acts`` names the placement of the activation quantizers (:mod:`quantgate.quant.simulate`);
``a_bits`` / ``w_bits`` / ``kv_bits`` set the width of an integer format (2..8), not of a float or
block-scaled format (FP8 E4M3 / E5M2, FP4, MXFP8, MXFP4, NVFP4 are formats of their own: the scheme
name picks one).

Mitigations are options of the simulated schemes, applied to the float model before it is quantized
(:mod:`quantgate.quant.mitigate`): ``smooth=ALPHA`` (SmoothQuant), ``rotate=residual|online`` (Hadamard
rotation of the residual stream, online also of the FFN's down-projection input), ``keep=auto`` (the
FFN blocks that hold massive activations, found on the calibration batches, stay in full precision).
The ``kv_*`` options of the KV schemes quantize the key-value cache as it is written (``kv_bits``,
``kv_granularity``, ``kv_group``; ``sink=K`` keeps its first K tokens in full precision).

An option the scheme would not read as its other options set it up (``estimator=`` of dynamic
activations, ``smooth=`` without quantized activations, ``group_size=`` without groups: each class's
:meth:`Scheme.unread`) is refused, as is a key given twice; ``keep`` patterns that match no module of
the model are refused when it is quantized.

A scheme is a config object, as in torchao: :class:`SimulatedScheme`, :class:`TorchaoScheme` (and
:class:`TorchaoStaticScheme`, which calibrates) and :class:`BnbScheme`, each declaring the options
it reads. Each config class has one registered :class:`Handler` (``@handles(SchemeClass)``, in the
backend's module) that quantizes a model with it, names the formats its models are saved in and its saved state,
and lays the structure out again for loading; a new
torchao config is one ``TorchaoScheme`` row in ``SCHEMES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn

from ..errors import InputError
from ..options import Option, Range, key_values, printed
from ..registry import Registry
from .formats import QUANTGATE, BackendState, Format, Manifest
from .quantizers import BLOCK, ESTIMATORS, FORMATS, INT_BITS

if TYPE_CHECKING:
    from torchao.core.config import AOBaseConfig

__all__ = [
    "TensorQuant",
    "Scheme",
    "CalibratedScheme",
    "SimulatedScheme",
    "TorchaoScheme",
    "TorchaoStaticScheme",
    "BnbScheme",
    "Handler",
    "handles",
    "handler_for",
    "SCHEMES",
    "get_scheme",
    "act_bits",
    "OPTIONS",
    "SchemeOption",
]


@dataclass(frozen=True)
class TensorQuant:
    """How one kind of tensor is quantized.

    format: int2 .. int8, fp8-e4m3, fp8-e5m2, fp4-e2m1, or a block-scaled mxfp8 / mxfp4 / nvfp4 (whose
    blocks set the granularity). granularity: weights tensor/channel/group (group_size along the input
    dim); activations tensor/token/channel; the KV cache token (one range per token and head), group
    (group_size channels of a token) or channel (keys per channel over blocks of group_size tokens,
    values per token, as KIVI). dynamic: activation ranges from each batch instead of calibration.
    estimator: weights minmax/mse (:func:`~.quantizers.quantize_weight`); static activations minmax,
    running-minmax (momentum), percentile (percentile), mse, running-percentile (momentum and percentile)
    (:class:`~.quantizers.RangeObserver`). calib_skip: static activation ranges leave out the first
    calib_skip positions of each sequence (the BOS switch; :class:`~.simulate.ActQuant`). The other fields'
    valid values depend on the role (weight, activation or KV cache): the :class:`Scheme` holding it checks
    them (``OPTIONS``).
    """

    format: str
    granularity: str = "tensor"
    symmetric: bool = True
    dynamic: bool = False
    estimator: str = "minmax"
    group_size: int = 128
    momentum: float = 0.9
    percentile: float = 99.999
    calib_skip: int = 0  # static activation ranges: positions left out at the start of each sequence

    def __post_init__(self):
        if self.format not in FORMATS:
            raise InputError(f"unknown quantization format {self.format!r}; valid: {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Scheme:
    """What every scheme has: a name (its row in ``SCHEMES``), a description, the modules kept in full
    precision (``keep`` patterns, besides the LM head; attention gates unless ``gates``), and, where the
    scheme needs a GPU, why. ``options`` names the ``OPTIONS`` a scheme class reads."""

    name: str
    description: str
    _: KW_ONLY
    keep: tuple[str, ...] = ()  # module-name patterns kept in full precision, besides the LM head
    gates: bool = False  # quantize the attention-gate projections too (default: full precision)
    needs_cuda: str | None = None  # why, when the scheme needs a GPU
    options: ClassVar[tuple[str, ...]] = ("keep", "gates")

    def __post_init__(self):
        for key, value in _options(self).items():
            OPTIONS[key].check(self.name, key, value)
        self.check_combination()
        named = SCHEMES.get(self.name)  # None while SCHEMES is built, and for a row of its own
        if named is not None:
            base = _options(named)
            refuse_unread(self, [k for k, v in _options(self).items() if base.get(k) != v])

    def range_kind(self) -> str:
        """Where the scheme's activation scales come from, in words (a study report's "Which fix?" column)."""
        return "weights only"

    @property
    def kv_sink(self) -> int:
        """The first tokens of the KV cache this scheme keeps in full precision (0: none, or no KV cache quantized)."""
        return 0

    def without_sink(self) -> Scheme | None:
        """The same scheme with its KV-cache sink tokens quantized too; None where it keeps none."""
        return None

    @property
    def task_head_in_float(self) -> bool:
        """Whether the family's whole task head (not just the LM head) stays in full precision."""
        return False

    def unfit(self, widths: frozenset[int]) -> str | None:
        """Why the scheme cannot quantize Linears of these input widths (None: it can)."""
        return None

    def export_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype config.json names for transformers to build the exported model in."""
        return model_dtype

    def check_combination(self) -> None:
        """Raise ValueError where option values do not go together (after each is checked alone)."""
        if "auto" in self.keep:  # SimulatedScheme overrides this: it resolves keep=auto
            raise InputError(
                f"{self.name}: keep=auto finds the FFNs with massive activations on calibration batches, which "
                f"only quantgate's simulated schemes run; name the modules instead (keep=PATTERN)"
            )

    def unread(self) -> dict[str, str]:
        """The options of this scheme's class that this scheme, as its other options set it up, never reads,
        each with why and what to do instead. One given in a scheme string, or changed from the named
        scheme's value, is refused (:func:`refuse_unread`): it would change nothing."""
        return {}

    @property
    def needs_calibration(self) -> bool:
        """Whether :func:`~quantgate.quant.quantize` needs calibration batches."""
        return False

    @property
    def export_calibration(self) -> bool:
        """Whether saving in another tool's format takes calibration batches the simulation does not need
        (NVFP4: compressed-tensors' activations have a static per-tensor scale, from their maximum)."""
        return False

    def __str__(self) -> str:
        base = SCHEMES[self.name]
        changed = [f"{k}={printed(v)}" for k, v in _options(self).items() if _options(base).get(k) != v]
        return self.name + (":" + ",".join(changed) if changed else "")


@dataclass(frozen=True)
class CalibratedScheme(Scheme):
    """A scheme that can read calibration batches (``calib`` of them): for static activation ranges, and
    for the mitigations every backend applies the same way before quantizing (SmoothQuant's ``smooth``)."""

    calib: int = 16  # calibration batches used when the scheme needs them
    smooth: float | None = None  # SmoothQuant's migration strength alpha


@dataclass(frozen=True)
class SimulatedScheme(CalibratedScheme):
    """Fake quantization in float (:mod:`quantgate.quant.simulate`): any integer width, FP8, FP4 and
    block-scaled formats, any placement, the KV cache, and the mitigations (module docstring)."""

    weight: TensorQuant | None = None
    act: TensorQuant | None = None
    acts: str = "linear-inputs"  # where activations are quantized: linear-inputs | bondarenko (simulate.py)
    kv: TensorQuant | None = None  # the key-value cache, quantized as it is written (dynamic)
    sink: int = 0  # first tokens of the KV cache kept in full precision
    rotate: str = "none"  # Hadamard rotation: none | residual | online (residual + FFN down-projection input)
    options: ClassVar[tuple[str, ...]] = (
        "w_granularity",
        "w_estimator",
        "w_symmetric",
        "group_size",
        "a_granularity",
        "a_symmetric",
        "dynamic",
        "estimator",
        "momentum",
        "percentile",
        "calib_skip",
        "a_bits",
        "w_bits",
        "acts",
        "keep",
        "gates",
        "calib",
        "kv_bits",
        "kv_granularity",
        "kv_group",
        "sink",
        "smooth",
        "rotate",
    )

    def check_combination(self) -> None:
        a, kv = self.act, self.kv
        if a is not None and a.dynamic and a.granularity == "channel":
            raise InputError(f"{self.name}: dynamic activations are per tensor or per token, not per channel")
        if a is not None and not a.dynamic and a.granularity == "token":
            raise InputError(f"{self.name}: per-token activation ranges are dynamic; add dynamic=true")
        if a is not None and a.format in BLOCK and (not a.dynamic or self.acts != "linear-inputs"):
            raise InputError(
                f"{self.name}: {a.format} takes each block's scale from the block at run time and blocks "
                f"the reduction dim of a matmul: its activations are dynamic at acts=linear-inputs"
            )
        if kv is not None and (
            kv.format in BLOCK
            or kv.format == "fp4-e2m1"
            or not kv.dynamic
            or kv.granularity not in ("token", "group", "channel")
        ):
            raise InputError(
                f"{self.name}: the KV cache takes integer or FP8 formats, dynamic, per token, group or "
                f"channel; got {kv.format}, {kv.granularity}, dynamic={kv.dynamic}"
            )
        if self.smooth is not None and self.rotate != "none":
            raise InputError(f"{self.name}: smooth= folds its scales into the norms that rotate= removes; pick one")

    def unread(self) -> dict[str, str]:
        return dict(self._unread())

    def _unread(self) -> Iterator[tuple[str, str]]:
        """(option, why) for each option :meth:`unread` names."""
        w, a, kv = self.weight, self.act, self.kv
        if w is not None and w.format in BLOCK:
            fixed = f"the weights are {w.format}, whose blocks of {BLOCK[w.format][1]} set their scales"
            yield from ((k, fixed) for k in ("w_granularity", "w_estimator", "w_symmetric", "group_size"))
        elif w is not None:
            if w.granularity != "group":
                yield (
                    "group_size",
                    f"it sizes weight groups, and w_granularity is {w.granularity} (w_granularity=group groups them)",
                )
            if w.format not in INT_BITS:
                yield "w_symmetric", f"{w.format} scales are symmetric"
        if a is not None and a.format in BLOCK:
            fixed = f"the activations are {a.format}, each block's scale taken from the block at run time"
            options = ("a_granularity", "a_symmetric", "dynamic", "estimator", "momentum", "percentile", "calib_skip")
            yield from ((k, fixed) for k in options)
        elif a is not None:
            if a.dynamic:
                dynamic = (
                    "it calibrates static activation ranges, and this scheme's come from each batch (dynamic=false)"
                )
                yield from ((k, dynamic) for k in ("estimator", "momentum", "percentile", "calib_skip"))
            else:
                for key, estimator in (("momentum", "running-minmax"), ("percentile", "percentile")):
                    if a.estimator not in (estimator, "running-percentile"):
                        yield (
                            key,
                            f"estimator={estimator} reads it, and the estimator is {a.estimator} "
                            f"(estimator=running-percentile reads it too)",
                        )
            if a.format not in INT_BITS:
                yield "a_symmetric", f"{a.format} scales are symmetric"
        if kv is not None and kv.granularity == "token":
            yield "kv_group", "it sizes kv_granularity=group or channel ranges, and these are per token"
        if kv is None:
            yield (
                "sink",
                f"it keeps the first KV-cache tokens in full precision, and this scheme leaves the cache in "
                f"float (to quantize it, use a kv scheme such as kv4-int4:sink={self.sink})",
            )
        if w is None and a is None:  # the KV cache alone: no module is quantized, so none is kept
            cache = "this scheme quantizes the KV cache alone, at every attention"
            yield from (("acts", f"{cache}, not at placed sites"), ("keep", cache), ("gates", cache))
        if a is None:
            yield "smooth", _NOTHING_TO_SMOOTH
        if not (self.needs_calibration or self.export_calibration):
            yield "calib", _NOTHING_TO_CALIBRATE

    @property
    def needs_calibration(self) -> bool:
        static = self.act is not None and not self.act.dynamic
        return static or self.smooth is not None or "auto" in self.keep

    @property
    def export_calibration(self) -> bool:
        return self.act is not None and self.act.format == "nvfp4" and not self.needs_calibration

    @property
    def kv_sink(self) -> int:
        return self.sink

    def without_sink(self) -> Scheme | None:
        return dataclasses.replace(self, sink=0) if self.sink else None

    @property
    def task_head_in_float(self) -> bool:
        return self.acts == "bondarenko"

    def unfit(self, widths: frozenset[int]) -> str | None:
        w = self.weight
        if w is None or w.granularity != "group":
            return None
        bad = sorted(x for x in widths if x % min(w.group_size, x))
        return f"its weight groups of {w.group_size} do not divide input width {bad[0]}" if bad else None

    def export_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """bfloat16 for NVFP4 weights, which compressed-tensors 0.20 decompresses to bfloat16 whatever the model's
        dtype (a float32 model then fails in its first matmul); else the model's own."""
        return torch.bfloat16 if self.weight is not None and self.weight.format == "nvfp4" else model_dtype

    def range_kind(self) -> str:
        parts = []
        a = self.act
        if a is not None:
            if a.format in BLOCK:
                block = BLOCK[a.format][1]
                parts.append(
                    f"per block of {block} (E4M3) x per tensor"
                    if a.format == "nvfp4"
                    else f"per block of {block} (E8M0)"
                )
            else:
                parts.append(f"per {a.granularity}, " + ("dynamic" if a.dynamic else "static"))
        if self.kv is not None:
            parts.append(f"KV cache per {self.kv.granularity}" + (f", first {self.sink} kept" if self.sink else ""))
        return "; ".join(parts) or super().range_kind()


@dataclass(frozen=True)
class TorchaoScheme(CalibratedScheme):
    """torchao's ``quantize_`` with the named config class of ``torchao.quantization`` (real kernels);
    ``smooth=ALPHA`` folds SmoothQuant's scales into the float model first (its real int8 path)."""

    config: str = ""
    weight_only: bool = False  # the config leaves the activations in float
    options: ClassVar[tuple[str, ...]] = ("keep", "gates", "smooth", "calib")

    def unread(self) -> dict[str, str]:
        others = "torchao-int8-dynamic and torchao-int8-static quantize them"
        why = {"smooth": f"{_NOTHING_TO_SMOOTH} ({others})"} if self.weight_only else {}
        return why if self.needs_calibration else why | {"calib": _NOTHING_TO_CALIBRATE}

    @property
    def needs_calibration(self) -> bool:
        return self.smooth is not None

    def range_kind(self) -> str:
        return "weights only (torchao kernel)" if self.weight_only else "per token, dynamic (torchao kernel)"

    def torchao_config(self) -> AOBaseConfig:
        import torchao.quantization  # torchao is optional: imported at first use

        return getattr(torchao.quantization, self.config)()


@dataclass(frozen=True)
class TorchaoStaticScheme(TorchaoScheme):
    """torchao's static int8 config: per-tensor symmetric activation scales calibrated by quantgate."""

    @property
    def needs_calibration(self) -> bool:
        return True

    def range_kind(self) -> str:
        return "per tensor, static (torchao int8 kernel)"

    def torchao_config(self, act_scale: torch.Tensor | None = None) -> AOBaseConfig:
        """The config for one Linear whose input scale is ``act_scale`` (max |x| / 127)."""
        import torchao.quantization  # torchao is optional: imported at first use
        from torchao.quantization.granularity import PerRow, PerTensor  # torchao, likewise

        return getattr(torchao.quantization, self.config)(
            act_quant_scale=act_scale, granularity=[PerTensor(), PerRow()]
        )


@dataclass(frozen=True)
class BnbScheme(Scheme):
    """bitsandbytes' LLM.int8: int8 matmuls with the outlier features above ``threshold`` kept in 16-bit."""

    threshold: float = 6.0
    options: ClassVar[tuple[str, ...]] = ("keep", "gates", "threshold")

    def range_kind(self) -> str:
        return f"per token, outlier columns (> {self.threshold:g}) in 16-bit"


@dataclass(frozen=True)
class Handler:
    """How one scheme class is applied, saved and loaded: the whole backend. ``apply(model, scheme, calibrate)``
    quantizes ``model`` in place (``calibrate(model)`` runs the calibration batches); ``restore(model, scheme,
    manifest)`` lays out the same structure without calibrating, for loading a saved model (``manifest``: its
    quantization.json, a :class:`~quantgate.quant.formats.Manifest` whose ``state`` is the backend's own, typed);
    ``export(model, scheme)`` -> ``(format, why)`` picks the format ``qg.save`` writes (``quantgate``, or one of
    ``formats``); ``state``: the backend's saved state (a :class:`~quantgate.quant.formats.BackendState` record,
    None: it keeps none); ``assign``: the saved state replaces the parameters (tensor subclasses) instead of being
    copied in."""

    apply: Callable[[nn.Module, Scheme, Callable | None], nn.Module]
    restore: Callable[[nn.Module, Scheme, Manifest], nn.Module]
    export: Callable[[nn.Module, Scheme], tuple[str, str]]
    formats: tuple[Format, ...] = ()
    state: type[BackendState] | None = None
    assign: bool = False


def quantgate_format_only(model: nn.Module, scheme: Scheme) -> tuple[str, str]:
    """The ``export`` of a backend no other tool's format holds: quantgate's own."""
    return QUANTGATE.name, f"no other tool's format is known to hold {type(scheme).__name__} ({scheme.name})"


# the handler of each scheme class, registered by @handles in the backend modules (simulate.py, backends.py); the
# modules that look a handler up import those explicitly (quant/__init__.py, export.py, manifest.py)
HANDLERS: Registry[type, Handler] = Registry("scheme handler")


def handles(
    scheme_class: type[Scheme],
    *,
    restore: Callable[..., nn.Module],
    export: Callable[..., tuple[str, str]] = quantgate_format_only,
    formats: tuple[Format, ...] = (),
    state: type[BackendState] | None = None,
    assign: bool = False,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Register the decorated ``apply`` function as the handler of ``scheme_class``, the whole backend: with
    ``restore`` (the structure of a saved model, without calibrating, from its manifest), ``export(model, scheme)``
    -> ``(format, why)``: the format :func:`quantgate.save` writes (``quantgate``, quantgate's own, with why no
    other tool's holds it, or the name of one of ``formats``, the :class:`~quantgate.quant.formats.Format` entries
    the backend writes and reads); ``state``: the record of what restoring needs beside the scheme and the weights
    (``state.of(model)`` is saved in the manifest, and ``restore`` reads it as ``manifest.state``); ``assign``: the
    saved state replaces the parameters (tensor subclasses) instead of being copied in."""

    def register(apply: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        HANDLERS.add(scheme_class, Handler(apply, restore, export, formats, state, assign))
        return apply

    return register


def handler_for(scheme: Scheme) -> Handler:
    """The handler registered for ``scheme``'s class (or its nearest registered base class)."""
    for cls in type(scheme).__mro__:
        if cls in HANDLERS:
            return HANDLERS[cls]
    raise TypeError(
        f"no handler is registered for {type(scheme).__name__} ({scheme.name}); register one with "
        f"@handles({type(scheme).__name__}, restore=...)"
    )


@dataclass(frozen=True)
class SchemeOption(Option):
    """A scheme option: an :class:`~quantgate.options.Option` (type, valid values), where it lives (``weight``,
    ``act``, ``kv`` or None: the scheme itself), the field it sets there, and accepted aliases."""

    _: KW_ONLY
    where: str | None
    field: str
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, the value it stands for)

    def read(self, holder: object) -> object:
        return getattr(holder, self.field)

    def write(self, value: object) -> object:
        """The field value that option value ``value`` stands for."""
        return next((meant for alias, meant in self.aliases if alias == value), value)


@dataclass(frozen=True)
class BitsOption(SchemeOption):
    """The width of an integer format, kept in the format's name (``a_bits=6``: format ``int6``);
    None for float and block-scaled formats, whose width is fixed."""

    def read(self, holder: object) -> int | None:
        assert isinstance(holder, TensorQuant)  # the weight, act or kv of a scheme
        return INT_BITS.get(holder.format)

    def write(self, value: object) -> str:
        return f"int{value}"


_BITS = Range.between(2, 8)
OPTIONS: Registry[str, SchemeOption] = Registry(
    "scheme option",
    {
        "w_granularity": SchemeOption(str, ("tensor", "channel", "group"), where="weight", field="granularity"),
        "w_estimator": SchemeOption(str, ("minmax", "mse"), where="weight", field="estimator"),
        "w_symmetric": SchemeOption(bool, where="weight", field="symmetric"),
        "group_size": SchemeOption(int, Range.between(1), where="weight", field="group_size"),
        "a_granularity": SchemeOption(str, ("tensor", "token", "channel"), where="act", field="granularity"),
        "a_symmetric": SchemeOption(bool, where="act", field="symmetric"),
        "dynamic": SchemeOption(bool, where="act", field="dynamic"),
        "estimator": SchemeOption(str, ESTIMATORS, where="act", field="estimator"),
        # r = m r + (1 - m) x
        "momentum": SchemeOption(float, Range.between(0.0, 1.0, hi_open=True), where="act", field="momentum"),
        # clips (100 - p)% each side
        "percentile": SchemeOption(float, Range.between(50.0, 100.0, lo_open=True), where="act", field="percentile"),
        # first positions of each sequence, not calibrated
        "calib_skip": SchemeOption(int, Range.between(0), where="act", field="calib_skip"),
        "a_bits": BitsOption(int, _BITS, where="act", field="format"),
        "w_bits": BitsOption(int, _BITS, where="weight", field="format"),
        # "everything" was a placement that missed the mid-block residual sums: it now means bondarenko
        "acts": SchemeOption(
            str, ("linear-inputs", "bondarenko"), where=None, field="acts", aliases=(("everything", "bondarenko"),)
        ),
        "keep": SchemeOption(tuple, where=None, field="keep"),
        "gates": SchemeOption(bool, where=None, field="gates"),
        "calib": SchemeOption(int, Range.between(1), where=None, field="calib"),  # batches
        # LLM.int8 outlier magnitude; 0: none kept
        "threshold": SchemeOption(float, Range.between(0.0), where=None, field="threshold"),
        "kv_bits": BitsOption(int, _BITS, where="kv", field="format"),
        "kv_granularity": SchemeOption(str, ("token", "group", "channel"), where="kv", field="granularity"),
        # channels (group) or tokens (channel) per range
        "kv_group": SchemeOption(int, Range.between(1), where="kv", field="group_size"),
        "sink": SchemeOption(int, Range.between(0), where=None, field="sink"),  # tokens
        "smooth": SchemeOption(float, Range.between(0.0, 1.0), where=None, field="smooth"),  # SmoothQuant alpha
        "rotate": SchemeOption(str, ("none", "residual", "online"), where=None, field="rotate"),
    },
)


def _options(s: Scheme) -> dict[str, object]:
    out: dict[str, object] = {}
    for key in type(s).options:
        opt = OPTIONS[key]
        holder = s if opt.where is None else getattr(s, opt.where)
        value = opt.read(holder) if holder is not None else None
        if value is not None:
            out[key] = value
    return out


def _allowed(s: Scheme) -> set[str]:
    """The options ``s`` can take: its class's, less those of a tensor kind it leaves unquantized."""
    return {k for k in type(s).options if (where := OPTIONS[k].where) is None or getattr(s, where)}


_NOTHING_TO_CALIBRATE = (
    "it counts calibration batches, and this scheme calibrates nothing (its activations are dynamic or float, "
    "and neither smooth= nor keep=auto is set)"
)
_NOTHING_TO_SMOOTH = (
    "it migrates activation outliers into the weights, and this scheme leaves the activations in float, so "
    "there is nothing to smooth"
)
_I8_STATIC_ACT = TensorQuant("int8", "tensor", symmetric=False, estimator="running-minmax")


def _block_scaled(name: str, description: str) -> SimulatedScheme:
    """Weights and Linear inputs in the block-scaled format the name ends with (mxfp8, mxfp4, nvfp4); the
    activations' block scales come from each block at run time."""
    fmt = name.split("-", 1)[1]
    return SimulatedScheme(name, description, weight=TensorQuant(fmt), act=TensorQuant(fmt, dynamic=True))


# filled below, one row at a time: a scheme compares itself with its named row, once there is one
SCHEMES: Registry[str, Scheme] = Registry("quantization scheme")
for _row in (
    SimulatedScheme(
        "w8a8-int8-static",
        "INT8 weights (symmetric, per tensor, min-max) and activations (asymmetric, per tensor, static ranges: "
        "running min-max, momentum 0.9, over the first calib batches of the calibration set: calib=16 unless "
        "set, and the quantization record counts the batches used) at the input of every nn.Linear but the LM "
        "head and the attention gates, and nowhere else (acts=linear-inputs): the residual stream, the norm "
        "outputs and the attention's q/k/v and softmax stay in float",
        weight=TensorQuant("int8"),
        act=_I8_STATIC_ACT,
    ),
    SimulatedScheme(
        "w8a8-int8-bondarenko",
        "Bondarenko et al. 2023's W8A8 protocol (Qualcomm's outlier-free-transformers code): INT8 weights "
        "(symmetric, per tensor, min-max; embeddings and norm weights too) and activations (asymmetric, per "
        "tensor, running min-max, momentum 0.9, over the first calib batches of the calibration set: calib=16 "
        "unless set, and the quantization record counts the batches used) at every site of acts=bondarenko: "
        "embedding sum, norm outputs, q/k/v, softmax input and output, attention output, both residual sums, "
        "FFN activation and output; the LM head and the attention gates stay in full precision. These are the "
        "BERT ranges; the OPT ones are w_estimator=mse,estimator=running-percentile (percentile 99.999), with "
        "calib_skip=1 to keep the BOS position, which the reference's text blocks lack, out of the ranges",
        weight=TensorQuant("int8"),
        act=_I8_STATIC_ACT,
        acts="bondarenko",
    ),
    SimulatedScheme(
        "w8a16-int8-bondarenko",
        "The weights of w8a8-int8-bondarenko alone (INT8, symmetric, per tensor, min-max; embeddings and norm "
        "weights too), activations in float: with w16a8-int8-bondarenko, it splits W8A8's loss into its weight "
        "and activation parts",
        weight=TensorQuant("int8"),
        acts="bondarenko",
    ),
    SimulatedScheme(
        "w16a8-int8-bondarenko",
        "The activations of w8a8-int8-bondarenko alone (INT8 at every site of acts=bondarenko, static per-tensor "
        "ranges), weights in float",
        act=_I8_STATIC_ACT,
        acts="bondarenko",
    ),
    SimulatedScheme(
        "w8a8-int8-dynamic",
        "INT8 weights per output channel, activations symmetric per token from each batch (dynamic)",
        weight=TensorQuant("int8", "channel"),
        act=TensorQuant("int8", "token", dynamic=True),
    ),
    SimulatedScheme(
        "w8a8-fp8-e4m3",
        "FP8 E4M3 weights and activations with per-tensor scales (activations static from calibration; "
        "saturation at 448 counted)",
        weight=TensorQuant("fp8-e4m3"),
        act=TensorQuant("fp8-e4m3"),
    ),
    SimulatedScheme(
        "w8a8-fp8-e5m2",
        "FP8 E5M2 weights and activations with per-tensor scales (static activations; saturation counted)",
        weight=TensorQuant("fp8-e5m2"),
        act=TensorQuant("fp8-e5m2"),
    ),
    SimulatedScheme(
        "w4a4-fp4-e2m1",
        "FP4 E2M1 weights and activations with one scale per tensor (activations static from calibration; "
        "saturation at 6 x scale counted): the contrast to the block-scaled FP4 formats",
        weight=TensorQuant("fp4-e2m1"),
        act=TensorQuant("fp4-e2m1"),
    ),
    _block_scaled(
        "w8a8-mxfp8",
        "OCP MXFP8: E4M3 elements, one power-of-two (E8M0) scale per block of 32 along the input dim, "
        "weights and activations (scales from each block at run time; torchao's emulation)",
    ),
    _block_scaled(
        "w4a4-mxfp4",
        "OCP MXFP4: E2M1 elements, one power-of-two (E8M0) scale per block of 32, weights and activations",
    ),
    _block_scaled(
        "w4a4-nvfp4",
        "NVIDIA NVFP4: E2M1 elements, one FP8 E4M3 scale per block of 16 under a float32 scale per tensor, "
        "weights and activations",
    ),
    SimulatedScheme(
        "kv8-int8",
        "The KV cache alone in INT8: keys and values as written, asymmetric, one range per "
        "token and head (weights and activations in float)",
        kv=TensorQuant("int8", "token", symmetric=False, dynamic=True, group_size=32),
    ),
    SimulatedScheme(
        "kv4-int4",
        "The KV cache alone in INT4, asymmetric, one range per token and head; "
        "kv_granularity=channel is KIVI's keys per channel over blocks of kv_group tokens",
        kv=TensorQuant("int4", "token", symmetric=False, dynamic=True, group_size=32),
    ),
    SimulatedScheme(
        "kv8-fp8-e4m3",
        "The KV cache alone in FP8 E4M3, one scale per token and head",
        kv=TensorQuant("fp8-e4m3", "token", dynamic=True, group_size=32),
    ),
    SimulatedScheme("w8-int8", "INT8 weight-only, symmetric per output channel", weight=TensorQuant("int8", "channel")),
    SimulatedScheme(
        "w4-int4-group",
        "INT4 weight-only, asymmetric, groups of 128 input channels",
        weight=TensorQuant("int4", "group", symmetric=False),
    ),
    TorchaoScheme(
        "torchao-int8-dynamic",
        "torchao Int8DynamicActivationInt8WeightConfig (real int8 kernels)",
        config="Int8DynamicActivationInt8WeightConfig",
    ),
    TorchaoScheme(
        "torchao-int8-weight-only", "torchao Int8WeightOnlyConfig", config="Int8WeightOnlyConfig", weight_only=True
    ),
    TorchaoStaticScheme(
        "torchao-int8-static",
        "torchao Int8StaticActivationInt8WeightConfig: per-tensor symmetric activation scales "
        "calibrated here, per-channel weights",
        config="Int8StaticActivationInt8WeightConfig",
    ),
    TorchaoScheme(
        "torchao-fp8-weight-only",
        "torchao Float8WeightOnlyConfig",
        config="Float8WeightOnlyConfig",
        weight_only=True,
    ),
    TorchaoScheme(
        "torchao-fp8-dynamic",
        "torchao Float8DynamicActivationFloat8WeightConfig",
        config="Float8DynamicActivationFloat8WeightConfig",
        needs_cuda="FP8 matmuls need a CUDA GPU with compute capability >= 8.9 (Ada/Hopper); on this "
        "machine use the simulated scheme w8a8-fp8-e4m3:dynamic=true",
    ),
    BnbScheme(
        "llm-int8",
        "bitsandbytes LLM.int8 (Linear8bitLt): int8 matmul with outlier features above the "
        "threshold (6.0) kept in 16-bit",
    ),
):
    SCHEMES.add(_row.name, _row)


def get_scheme(text: str | Scheme) -> Scheme:
    """Parse ``name[:key=value,...]``; unknown names or options, a key given twice, values outside an
    option's valid range (``OPTIONS``) and options the scheme would not read (:meth:`Scheme.unread`) raise an
    InputError naming the option."""
    if isinstance(text, Scheme):
        return text
    name, _, arg = str(text).strip().partition(":")
    scheme = SCHEMES.lookup(name)
    changes: dict[str | None, dict[str, Any]] = {None: {}, "weight": {}, "act": {}, "kv": {}}
    allowed = _allowed(scheme)
    given = list(
        key_values(name, arg, lambda k: OPTIONS[k].type if k in allowed else None, valid=", ".join(sorted(allowed)))
    )
    for key, value in given:
        opt = OPTIONS[key]
        if isinstance(opt, BitsOption):
            assert isinstance(value, int)  # a BitsOption's type is int
            _check_bits(scheme, key, value)
        changes[opt.where][opt.field] = opt.write(value)
    parts = {w: dataclasses.replace(getattr(scheme, w), **c) for w, c in changes.items() if w is not None and c}
    parsed = dataclasses.replace(scheme, **parts, **changes[None])  # all at once: the Scheme checks the result
    refuse_unread(parsed, [key for key, _ in given])  # those set to the value they had, too
    return parsed


def refuse_unread(scheme: Scheme, keys: list[str]) -> None:
    """Raise ValueError naming the first of ``keys`` that ``scheme`` does not read (:meth:`Scheme.unread`)."""
    unread = scheme.unread()
    for key in keys:
        if key in unread:
            value = printed(_options(scheme).get(key))
            raise InputError(f"{scheme.name}: {key}={value} does nothing here: {unread[key]}; leave it out")


def _check_bits(scheme: Scheme, key: str, value: int) -> None:
    where = OPTIONS[key].where
    assert where is not None  # a BitsOption sets a tensor kind's format
    fmt = getattr(scheme, where).format
    if fmt not in INT_BITS:
        kind = "a block-scaled format" if fmt in BLOCK else "a float format"
        raise InputError(
            f"{scheme.name}: {key} sets the width of an integer format, but this scheme's "
            f"{OPTIONS[key].where}s are {fmt}, {kind} of fixed width (pick one by scheme name, or use "
            f"an INT scheme such as w8a8-int8-static:{key}={value})"
        )
    OPTIONS[key].check(scheme.name, key, value)


def act_bits(scheme: str | Scheme) -> tuple[str, int | None]:
    """``(base, bits)``: the scheme printed without its activation width, and that width (None where
    the activations are not integer): the schemes of a bit sweep share their base."""
    s = get_scheme(scheme)
    bits = _options(s).get("a_bits")
    if bits is None:
        return str(s), None
    named = SCHEMES[s.name]
    # a_bits is read off an integer activation format, which only a simulated scheme has, as its named row does
    assert isinstance(bits, int) and isinstance(s, SimulatedScheme) and isinstance(named, SimulatedScheme)
    assert s.act is not None and named.act is not None
    base = dataclasses.replace(s, act=dataclasses.replace(s.act, format=named.act.format))
    return str(base), bits
