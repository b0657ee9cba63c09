"""Gate modules. Each turns the attention input x (B, N, d_model) into a multiplier applied at
its position in the attention block:

* ``value``  (G2): multiplies the value projection output (B, N, Hkv * Dh);
* ``sdpa``   (G1, Bondarenko, HyGA): multiplies the SDPA output, broadcastable to (B, Hq, N, Dh);
  gates with ``needs_output`` (HyGA) also read that output h;
* ``output`` (G5): multiplies the output projection's result (B, N, d_model).

Each class is one gate kind, registered by ``@gate_kind`` (:mod:`quantgate.variants` parses and prints
the registry): its position, activation, bias initialisation (``bias_for``, above ``floor``) and the
Linears that read x (``x_readers``) are its own. Gate values lie in [0, 1] ([0.5, 1] for NS-sigmoid).
Biases start at logit(pi_init), weights at N(0, init_std). ``open_()`` sets every weight to 0 and
every bias/logit to 30, which makes the gate exactly 1 in float32: the model then computes what the
ungated model computes.

``finetune=true`` (Bondarenko et al.'s fine-tuning set-up, for adding a gate to a pretrained model):
weights start at N(0, 0.001) and the gate output is divided by its initial value, so the gated model
starts within a hair of the pretrained function and the gate ranges over [0, 1 / initial value].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import InputError
from ..options import Option
from ..registry import Registry

__all__ = [
    "AttentionDims",
    "GATE_KINDS",
    "Gate",
    "GateKind",
    "GateSpecLike",
    "ProjGate",
    "build_gate",
    "gate_kind",
    "logit",
    "projection",
    "split_heads",
]


OPEN_LOGIT = 30.0  # sigmoid(30) == 1.0 in float32


@dataclass(frozen=True)
class AttentionDims:
    """Sizes of one attention block: model width, query/kv heads, head dim (q/k and v)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


FINETUNE_STD = 1e-3


class GateSpecLike(Protocol):
    """What a gate reads of its :class:`quantgate.variants.GateSpec` (a protocol: the variant grammar imports this
    module, for the gate kinds it parses)."""

    @property
    def kind(self) -> str: ...

    @property
    def pi_init(self) -> float: ...

    @property
    def low_rank(self) -> int | None: ...

    @property
    def bias_init(self) -> float: ...

    def option(self, name: str) -> object: ...


class GateLike(Protocol):
    """What the table reads of a registered gate class, a :class:`Gate` subclass (a protocol: the classes are
    registered while their module is still being defined)."""

    floor: ClassVar[float]
    position: ClassVar[str]  # where it multiplies: "sdpa" (G1), "value" (G2), "output" (G5)

    @classmethod
    def bias_for(cls, pi_init: float) -> float: ...

    def __init__(self, spec: GateSpecLike, dims: AttentionDims, std: float) -> None: ...


_G = TypeVar("_G", bound=GateLike)


@dataclass(frozen=True)
class GateKind:
    """A registered gate kind: its Gate class, description, default initial value, whether its projection can be
    factorised, its own options (name -> :class:`~quantgate.options.Option`: type, choices, default), which
    :class:`quantgate.variants.AttentionVariant` parses and prints, and other names its paper gives the common
    parameters (``{"d_int": "low_rank"}``), which parse as those."""

    gate: type[GateLike]
    description: str
    pi_init: float
    low_rank: bool
    options: dict[str, Option] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):  # every gate can start as the identity for fine-tuning a pretrained model
        self.options.setdefault("finetune", Option(bool, (True, False), False))


# the gate kinds, in the order variants list them: the @gate_kind classes below, and any a module above registers
# (quantgate.variants imports this module, so the grammar reads a filled table)
GATE_KINDS: Registry[str, GateKind] = Registry("gate kind")


def gate_kind(
    name: str,
    description: str,
    *,
    pi_init: float = 0.5,
    low_rank: bool = True,
    options: dict[str, Option] | None = None,
    aliases: dict[str, str] | None = None,
) -> Callable[[type[_G]], type[_G]]:
    """Class decorator: register a Gate subclass as the gate kind ``name``: a new gate is one decorated
    class (its position, activation, bias initialisation and x readers are class attributes and methods)."""

    def register(cls: type[_G]) -> type[_G]:
        GATE_KINDS.add(name, GateKind(cls, description, pi_init, low_rank, dict(options or {}), dict(aliases or {})))
        return cls

    return register


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class Gate(nn.Module):
    """Base: subclasses build their projections and define ``compute`` (the gate multiplier)."""

    position: ClassVar[str] = "sdpa"
    needs_output: ClassVar[bool] = False
    floor: ClassVar[float] = 0.0  # the gate's lowest value: pi_init must lie above it
    # its submodules that read x through an nn.Linear (a Sequential: its first layer), which rotations and
    # SmoothQuant rescale with x; None: not declared, so those refuse the gate
    x_readers: ClassVar[tuple[str, ...] | None] = None
    # why a rotation of the residual stream cannot pass through the gate; None: it can
    unrotatable: ClassVar[str | None] = None
    compute: Callable[..., torch.Tensor]  # each subclass's gate multiplier: compute(x), or compute(x, h)

    @classmethod
    def bias_for(cls, pi_init: float) -> float:
        """The pre-activation value at which :meth:`activation` gives ``pi_init``."""
        return logit(pi_init)

    def __init__(self, spec: GateSpecLike, dims: AttentionDims) -> None:
        super().__init__()
        self.spec, self.dims = spec, dims
        self.rescale = 1.0

    def activation(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(z)

    @property
    def initial_value(self) -> float:
        """The gate's value when its weights are zero."""
        return self.spec.pi_init

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        g = self.compute(*args)
        return g * self.rescale if self.rescale != 1.0 else g

    @torch.no_grad()
    def _finish_init(self) -> Gate:
        if self.spec.option("finetune"):
            for name, p in self.named_parameters():
                if not name.endswith(("bias", "logit")):
                    p.normal_(std=FINETUNE_STD)
            self.rescale = 1.0 / self.initial_value
        return self

    @torch.no_grad()
    def open_(self) -> Gate:
        for name, p in self.named_parameters():
            p.fill_(OPEN_LOGIT if name.endswith(("bias", "logit")) else 0.0)
        return self

    def extra_repr(self) -> str:
        return f"{self.spec}, position={self.position}"

    def x_reading_problem(self) -> str | None:
        """Why rotations and SmoothQuant cannot rescale this gate's reading of x with x; None: it reads x
        only through its ``x_readers``."""
        if self.x_readers is None:
            return "which of its layers read the residual stream is not declared (its x_readers)"
        return None


def projection(d_in: int, d_out: int, rank: int | None, bias_init: float, std: float) -> nn.Module:
    """x (..., d_in) -> logits (..., d_out): a Linear, or Linear(d_in, r) then Linear(r, d_out) at rank r."""
    layers = [nn.Linear(d_in, d_out)] if rank is None else [nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out)]
    for layer in layers:
        nn.init.normal_(layer.weight, std=std)
    nn.init.constant_(layers[-1].bias, bias_init)
    return layers[0] if rank is None else nn.Sequential(*layers)


class _HeadLinear(nn.Module):
    """Block-diagonal linear map, one (d_in x d_out) matrix per head: (B, H, N, d_in) -> (B, H, N, d_out)."""

    def __init__(self, heads: int, d_in: int, d_out: int, bias: float | None, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(heads, d_in, d_out) * std)
        self.bias = nn.Parameter(torch.full((heads, 1, d_out), bias)) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bhnd,hde->bhne", x, self.weight)
        return y if self.bias is None else y + self.bias


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads * d) -> (B, heads, N, d)."""
    b, n, _ = t.shape
    return t.view(b, n, heads, -1).transpose(1, 2)


class ProjGate(Gate):
    """A gate computed from one projection of x, ``proj``: x (B, N, d_model) -> logits (B, N, width(dims)),
    a Linear (or two at ``low_rank``) whose bias starts at the kind's initial logit; ``layout`` puts the
    logits where the gate multiplies (default: as they are), then the activation applies."""

    x_readers = ("proj",)

    @staticmethod
    def width(dims: AttentionDims) -> int:
        raise NotImplementedError

    @staticmethod
    def layout(z: torch.Tensor, dims: AttentionDims) -> torch.Tensor:
        return z

    def __init__(self, spec: GateSpecLike, dims: AttentionDims, std: float) -> None:
        super().__init__(spec, dims)
        self.proj = projection(dims.d_model, self.width(dims), spec.low_rank, spec.bias_init, std)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.layout(self.proj(x), self.dims))


@gate_kind("g1-elementwise", "G1: sigmoid(x W) per (head, channel) on the SDPA output (Qiu et al.)")
class ElementwiseGate(ProjGate):
    """G1 elementwise: sigmoid(x W) per (head, channel), (B, Hq, N, Dh)."""

    width = staticmethod(lambda dims: dims.n_heads * dims.head_dim)
    layout = staticmethod(lambda z, dims: split_heads(z, dims.n_heads))


@gate_kind("g1-headwise", "G1: one sigmoid(x w_h) per head on the SDPA output")
class HeadwiseGate(ProjGate):
    """G1 headwise: one sigmoid(x w_h) per head and token, (B, Hq, N, 1)."""

    width = staticmethod(lambda dims: dims.n_heads)
    layout = staticmethod(lambda z, dims: z.transpose(1, 2).unsqueeze(-1))


@gate_kind("g1-headshared", "G1: elementwise over d_head, shared by all heads")
class HeadSharedGate(ProjGate):
    """G1 head-shared: elementwise over d_head, the same for every head, (B, 1, N, Dh)."""

    width = staticmethod(lambda dims: dims.head_dim)
    layout = staticmethod(lambda z, dims: z.unsqueeze(1))


@gate_kind("g1-constant", "G1: input-independent learned sigmoid per (head, channel)", low_rank=False)
class ConstantGate(Gate):
    """G1 input-independent: a learned sigmoid per (head, channel), (1, Hq, 1, Dh)."""

    x_readers = ()

    def __init__(self, spec: GateSpecLike, dims: AttentionDims, std: float) -> None:
        super().__init__(spec, dims)
        self.logit = nn.Parameter(torch.full((dims.n_heads, 1, dims.head_dim), spec.bias_init))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit).unsqueeze(0)


@gate_kind("g1-ns-sigmoid", "G1 elementwise with 0.5 + 0.5 * sigmoid (never below 0.5)", pi_init=0.75)
class NSSigmoidGate(ElementwiseGate):
    """G1 elementwise with the non-saturating 0.5 + 0.5 * sigmoid(x W), in [0.5, 1]."""

    floor = 0.5

    @classmethod
    def bias_for(cls, pi_init: float) -> float:
        return logit(2 * pi_init - 1)

    def activation(self, z: torch.Tensor) -> torch.Tensor:
        return 0.5 + 0.5 * torch.sigmoid(z)


@gate_kind("g2-value", "G2: elementwise sigmoid(x W) on the values, from the key token")
class ValueGate(ProjGate):
    """G2: elementwise sigmoid(x W) on the value projection, from each key token's x."""

    position = "value"
    width = staticmethod(lambda dims: dims.n_kv_heads * dims.head_dim)


@gate_kind("g5-output", "G5: elementwise sigmoid(x W) after the output projection")
class OutputGate(ProjGate):
    """G5: elementwise sigmoid(x W) after the output projection."""

    position = "output"
    width = staticmethod(lambda dims: dims.d_model)
    unrotatable = (
        "it multiplies o_proj's output, the residual stream, channel by channel, and an elementwise product "
        "does not commute with a rotation"
    )


@gate_kind(
    "bondarenko",
    "Bondarenko et al.: per head sigmoid(G_h(x_h)) from the head's d_head slice of x",
    pi_init=0.25,
    low_rank=False,
    options={"mode": Option(str, ("linear", "mlp", "all-heads"), "linear")},
)
class BondarenkoGate(Gate):
    """Bondarenko et al. eq. 5: per head h, sigmoid(G_h(x_h)) with x_h the h-th of Hq equal slices
    of x; G_h = Linear(slice -> 1) (``linear``), slice -> slice/4 -> 1 with ReLU (``mlp``), or one
    Linear(d_model -> Hq) over all of x (``all-heads``). Output (B, Hq, N, 1)."""

    x_readers = ("proj",)  # mode=all-heads; the other modes read slices

    def __init__(self, spec: GateSpecLike, dims: AttentionDims, std: float) -> None:
        super().__init__(spec, dims)
        h, mode = dims.n_heads, spec.option("mode")
        if mode != "all-heads" and dims.d_model % h:
            raise InputError(
                f"bondarenko:mode={mode} slices x into {h} heads, but d_model={dims.d_model} "
                f"is not a multiple of {h}; use bondarenko:mode=all-heads"
            )
        c = dims.d_model // h
        if mode == "all-heads":
            self.proj = projection(dims.d_model, h, None, spec.bias_init, std)
        elif mode == "linear":
            self.head = _HeadLinear(h, c, 1, spec.bias_init, std)
        else:
            self.hidden = _HeadLinear(h, c, max(c // 4, 1), 0.0, std)
            self.head = _HeadLinear(h, max(c // 4, 1), 1, spec.bias_init, std)

    def x_reading_problem(self) -> str | None:
        if not hasattr(self, "proj"):
            return "it reads x in per-head slices of channels, not through an nn.Linear; use bondarenko:mode=all-heads"
        return super().x_reading_problem()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "proj"):
            return torch.sigmoid(self.proj(x)).transpose(1, 2).unsqueeze(-1)
        xh = split_heads(x, self.dims.n_heads)
        if hasattr(self, "hidden"):
            xh = F.relu(self.hidden(xh))
        return torch.sigmoid(self.head(xh))


@gate_kind(
    "hyga",
    "HyGA: sigmoid(X-gate(x) + H-gate(SDPA out)) * sigmoid(C-gate(all heads)), low rank d_int",
    options={
        "h_gate": Option(bool, (True, False), True),
        "c_gate": Option(bool, (True, False), True),
        "fusion": Option(str, ("sum", "product"), "sum"),
    },
    aliases={"d_int": "low_rank"},  # the paper's name for the gate rank
)
class HyGAGate(Gate):
    """HyGA (Zhou et al. 2026): sigmoid(X(x) + H(h)) * sigmoid(C(h)), h the SDPA output.

    X-gate: x W (full) or SiLU(x W_d) W_u per head at rank d_int; H-gate: SiLU(h_i W_d,i) W_u,i per
    head (rank d_int, or Dh when full); C-gate: Linear(Hq * Dh -> Hq) over all heads, head-wise.
    ``fusion=product`` multiplies separate sigmoids instead. The C-gate starts at 0.5.
    """

    x_readers = ("x_proj", "x_down")

    needs_output = True

    @property
    def initial_value(self) -> float:
        return self.spec.pi_init * (0.5 if self.spec.option("c_gate") else 1.0)

    def __init__(self, spec: GateSpecLike, dims: AttentionDims, std: float) -> None:
        super().__init__(spec, dims)
        h, dh, r = dims.n_heads, dims.head_dim, spec.low_rank
        if r is None:
            self.x_proj = projection(dims.d_model, h * dh, None, spec.bias_init, std)
        else:
            self.x_down = nn.Linear(dims.d_model, h * r, bias=False)
            nn.init.normal_(self.x_down.weight, std=std)
            self.x_up = _HeadLinear(h, r, dh, spec.bias_init, std)
        if spec.option("h_gate"):
            self.h_down = _HeadLinear(h, dh, r or dh, None, std)
            self.h_up = _HeadLinear(h, r or dh, dh, 0.0, std)
        if spec.option("c_gate"):
            self.c_proj = projection(h * dh, h, None, 0.0, std)

    def compute(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        heads = self.dims.n_heads
        if hasattr(self, "x_proj"):
            zx = split_heads(self.x_proj(x), heads)
        else:
            zx = self.x_up(F.silu(split_heads(self.x_down(x), heads)))
        zh = self.h_up(F.silu(self.h_down(h))) if hasattr(self, "h_down") else None
        if zh is None:
            g = torch.sigmoid(zx)
        elif self.spec.option("fusion") == "sum":
            g = torch.sigmoid(zx + zh)
        else:
            g = torch.sigmoid(zx) * torch.sigmoid(zh)
        if hasattr(self, "c_proj"):
            flat = h.transpose(1, 2).reshape(h.shape[0], h.shape[2], -1)  # (B, N, Hq * Dh)
            g = g * torch.sigmoid(self.c_proj(flat)).transpose(1, 2).unsqueeze(-1)
        return g


def build_gate(spec: GateSpecLike, dims: AttentionDims, init_std: float = 0.02) -> Gate:
    """The gate module for ``spec`` in an attention block of size ``dims``."""
    gate = GATE_KINDS[spec.kind].gate(spec, dims, init_std)
    assert isinstance(gate, Gate)  # gate kinds are registered by the Gate subclasses above
    return gate._finish_init()
