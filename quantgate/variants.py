"""AttentionVariant: everything that differs between the attention variants quantgate studies.

A variant is up to three components joined by ``+``, each ``name[:key=value,...]``:

* a gate (at most one): ``g1-elementwise``, ``g1-headwise``, ``g1-headshared``, ``g1-constant``,
  ``g1-ns-sigmoid`` (Qiu et al. 2025, after SDPA), ``g2-value`` (on the values), ``g5-output``
  (after the output projection), ``bondarenko`` (Bondarenko et al. 2023, per head from the head's
  slice of x), ``hyga`` (Zhou et al. 2026: X-gate + H-gate fused in one sigmoid, C-gate);
* ``clipped`` softmax: ``clip((zeta - gamma) * softmax + gamma, 0, 1)``, with ``gamma`` or the
  length-invariant ``alpha`` (gamma = -alpha / T, T the number of keys);
* ``sink``: one learnable logit per head appended to every softmax row (gpt-oss).

The gate kinds are the table of :mod:`quantgate.attention.gates` (``GATE_KINDS``, ``gate_kind``), which this
module imports (and re-exports), so the grammar always reads a filled table. ``vanilla`` names the plain softmax
attention. ``AttentionVariant.parse(str(v)) == v`` for every
variant; the printed form lists only parameters that differ from their defaults.

>>> str(AttentionVariant.parse("g1-headwise:pi_init=0.25+sink"))
'g1-headwise:pi_init=0.25+sink'
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .attention.gates import GATE_KINDS, GateKind, gate_kind, logit
from .errors import InputError
from .options import Range, key_values, printed

__all__ = [
    "AttentionVariant",
    "GateSpec",
    "ClipSpec",
    "SinkSpec",
    "GATE_KINDS",
    "GateKind",
    "gate_kind",
    "logit",
    "VariantLike",
]


# the bound on a softmax logit or stretch a variant takes: beyond it float16 (largest 65504) overflows in the
# softmax or the clipped stretch, and a logit of 1e4 already takes all of a row's mass (or none of it)
_LOGIT_MAX = 1e4


def _ranged(default, valid: Range):
    """A dataclass field whose valid values are ``valid`` (checked by :func:`_check_ranges`)."""
    return field(default=default, metadata={"valid": valid})


def _check_ranges(spec, owner: str) -> None:
    """Check every field of ``spec`` declared with :func:`_ranged` (None: not set)."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        if "valid" in f.metadata and value is not None:
            f.metadata["valid"].check(owner, f.name, value)


@dataclass(frozen=True)
class GateSpec:
    """A gate: its kind, initial value and rank; ``options`` holds kind-specific settings."""

    kind: str
    pi_init: float
    low_rank: int | None = None
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        spec = GATE_KINDS.lookup(self.kind)
        lo = spec.gate.floor
        if not lo < self.pi_init < 1.0:
            raise InputError(f"{self.kind}: pi_init must lie in ({lo}, 1), got {self.pi_init}")
        if self.low_rank is not None and (not spec.low_rank or self.low_rank < 1):
            raise InputError(
                f"{self.kind}: low_rank must be a positive int and is only valid for "
                f"{', '.join(k for k, s in GATE_KINDS.items() if s.low_rank)}"
            )
        given = dict(self.options)
        for name, value in given.items():
            if name not in spec.options:
                raise InputError(f"{self.kind}: unknown option {name!r}; valid: {_param_names(self.kind)}")
            spec.options[name].check(self.kind, name, value)
        full = {name: given.get(name, option.default) for name, option in spec.options.items()}
        object.__setattr__(self, "options", tuple(sorted(full.items())))

    def option(self, name: str) -> object:
        return dict(self.options)[name]

    @property
    def bias_init(self) -> float:
        """Pre-activation value that makes the gate output ``pi_init``."""
        return GATE_KINDS[self.kind].gate.bias_for(self.pi_init)

    def __str__(self) -> str:
        spec = GATE_KINDS[self.kind]
        params = []
        if self.pi_init != spec.pi_init:
            params.append(f"pi_init={self.pi_init!r}")
        if self.low_rank is not None:
            params.append(f"low_rank={self.low_rank}")
        for name, value in self.options:
            if value != spec.options[name].default:
                params.append(f"{name}={printed(value)}")
        return self.kind + (":" + ",".join(params) if params else "")


@dataclass(frozen=True)
class ClipSpec:
    """Clipped softmax (Bondarenko et al.): ``clip((zeta - gamma) * p + gamma, 0, 1)``."""

    gamma: float | None = _ranged(
        -0.025, Range.between(-_LOGIT_MAX, 0.0)
    )  # stretches below 0: small probabilities reach 0
    zeta: float = _ranged(1.0, Range.between(1.0, _LOGIT_MAX))  # stretches above 1, so large probabilities reach 1
    alpha: float | None = _ranged(None, Range.between(0.0, _LOGIT_MAX))  # gamma = -alpha / T

    def __post_init__(self):
        if (self.gamma is None) == (self.alpha is None):
            raise InputError("clipped: give exactly one of gamma (fixed) or alpha (gamma = -alpha / T)")
        _check_ranges(self, "clipped")

    def params(self, n_keys: int) -> tuple[float, float]:
        """(gamma, zeta) for rows of ``n_keys`` keys."""
        if self.gamma is not None:
            return self.gamma, self.zeta
        assert self.alpha is not None  # __post_init__: exactly one of gamma and alpha
        return -self.alpha / n_keys, self.zeta

    def __str__(self) -> str:
        params = [f"alpha={self.alpha!r}"] if self.alpha is not None else []
        if self.gamma is not None and self.gamma != -0.025:
            params.append(f"gamma={self.gamma!r}")
        if self.zeta != 1.0:
            params.append(f"zeta={self.zeta!r}")
        return "clipped" + (":" + ",".join(params) if params else "")


@dataclass(frozen=True)
class SinkSpec:
    """Learnable attention sink: one logit per head, initialised to ``init``."""

    init: float = _ranged(0.0, Range.between(-_LOGIT_MAX, _LOGIT_MAX))

    def __post_init__(self):
        _check_ranges(self, "sink")

    def __str__(self) -> str:
        return "sink" + (f":init={self.init!r}" if self.init != 0.0 else "")


@dataclass(frozen=True)
class AttentionVariant:
    """One attention variant: optional gate, optional clipped softmax, optional learned sink."""

    gate: GateSpec | None = None
    clip: ClipSpec | None = None
    sink: SinkSpec | None = None

    @property
    def is_vanilla(self) -> bool:
        return self.gate is None and self.clip is None and self.sink is None

    @classmethod
    def parse(cls, text: str | AttentionVariant | None) -> AttentionVariant:
        """Parse ``"g1-elementwise:pi_init=0.25+clipped:alpha=4+sink"`` (see the module docstring)."""
        if isinstance(text, AttentionVariant):
            return text
        if text is None or not str(text).strip():
            return cls()
        found: list[GateSpec | ClipSpec | SinkSpec] = []
        for comp in str(text).strip().split("+"):
            name, _, arg = comp.strip().partition(":")
            name = name.strip()
            params = _parse_params(name, arg)
            if name == "vanilla":
                if params or len(str(text).split("+")) > 1:
                    raise InputError("'vanilla' takes no parameters and combines with nothing")
                continue
            spec = _component(name, params)
            if any(type(s) is type(spec) for s in found):
                what = "more than one gate" if isinstance(spec, GateSpec) else f"{name} twice"
                raise InputError(f"variant {text!r} names {what}; give each component once")
            found.append(spec)
        return cls(_one(found, GateSpec), _one(found, ClipSpec), _one(found, SinkSpec))

    def __str__(self) -> str:
        comps = [str(c) for c in (self.gate, self.clip, self.sink) if c is not None]
        return "+".join(comps) if comps else "vanilla"

    @staticmethod
    def describe() -> dict[str, str]:
        """One line per variant name, for ``--list`` output."""
        return {
            "vanilla": "plain softmax attention",
            **{k: s.description for k, s in GATE_KINDS.items()},
            "clipped": "clipped softmax; params gamma (default -0.025), zeta (1.0) or alpha (gamma=-alpha/T)",
            "sink": "learnable per-head sink logit appended to every softmax row (gpt-oss); param init",
        }


VariantLike = AttentionVariant | str | None


def _component(name: str, params: dict[str, Any]) -> GateSpec | ClipSpec | SinkSpec:
    """The component ``name`` of a variant with its ``params`` (read by :func:`_parse_params`)."""
    if name in GATE_KINDS:
        aliases = GATE_KINDS[name].aliases
        both = [k for k, alias in aliases.items() if k in params and alias in params]
        if both:
            raise InputError(f"{name}: {both[0]} is another name for {aliases[both[0]]}; give one of them")
        params = {aliases.get(k, k): v for k, v in params.items()}
        pi_init = params.pop("pi_init", GATE_KINDS[name].pi_init)
        low_rank = params.pop("low_rank", None)
        return GateSpec(name, float(pi_init), None if low_rank is None else int(low_rank), tuple(params.items()))
    if name == "clipped":  # alpha alone: gamma follows from it (-alpha / T), its fixed default unset
        return ClipSpec(gamma=None, **params) if "alpha" in params and "gamma" not in params else ClipSpec(**params)
    if name == "sink":
        return SinkSpec(**params)
    raise InputError(f"unknown attention variant {name!r}; valid: {', '.join(_names())}")


S = TypeVar("S", GateSpec, ClipSpec, SinkSpec)


def _one(found: list[GateSpec | ClipSpec | SinkSpec], kind: type[S]) -> S | None:
    """The component of type ``kind`` among those ``found`` (at most one), None where there is none."""
    return next((s for s in found if isinstance(s, kind)), None)


def _names() -> list[str]:
    return ["vanilla", *GATE_KINDS, "clipped", "sink"]


def _param_names(name: str) -> str:
    if name in GATE_KINDS:
        spec = GATE_KINDS[name]
        return ", ".join(["pi_init", *(["low_rank"] if spec.low_rank else []), *spec.options])
    return {"clipped": "gamma, zeta, alpha", "sink": "init", "vanilla": "(none)"}.get(name, "")


_TYPES = {"pi_init": float, "low_rank": int, "gamma": float, "zeta": float, "alpha": float, "init": float}


def _parse_params(name: str, arg: str) -> dict[str, Any]:  # a value per key, of the type type_of gives it
    if name not in _names():
        raise InputError(f"unknown attention variant {name!r}; valid: {', '.join(_names())}")
    kind = GATE_KINDS.get(name)
    aliases = kind.aliases if kind else {}
    valid = [p.strip() for p in _param_names(name).split(",")] + list(aliases)
    kind_opts = kind.options if kind else {}

    def type_of(key: str) -> type | None:
        if key not in valid:
            return None
        return kind_opts[key].type if key in kind_opts else _TYPES[aliases.get(key, key)]

    return dict(key_values(name, arg, type_of, valid=", ".join(valid), noun="parameter"))
