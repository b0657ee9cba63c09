"""The simulated schemes' faster arithmetic (issue 44) against the unfused reference, scheme by scheme.

Reference: the integer round trip written out as PyTorch's fake-quantize formula,
``(clamp(round(x * (1 / s)) + z, qmin, qmax) - z) * s``, with the scale and zero point computed from the range
at every call (as before each frozen quantizer kept its grid). A model quantized and run with the reference and
one quantized and run as shipped must have equal weights, buffers and logits (torch.equal), in float32 (and
bfloat16 for the integer round trip's other branch). The float formats' round trips are held to torchao's,
function by function, in tests/test_fast_quant.py.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import quantgate as qg
from quantgate.quant.schemes import SCHEMES, SimulatedScheme

quantizers = importlib.import_module("quantgate.quant.quantizers")
simulate = importlib.import_module("quantgate.quant.simulate")

SIMULATED = [name for name, s in SCHEMES.items() if isinstance(s, SimulatedScheme)]
VARIANTS = ["w8a8-int8-static:smooth=0.5", "w8a8-int8-static:rotate=online", "w8a8-int8-bondarenko:calib_skip=1"]


def _reference_fake_int(x, scale, zero, bits, symmetric):
    qmin, qmax = quantizers.int_grid(bits, symmetric)
    scale, zero = scale.float(), torch.round(zero.float())
    if scale.numel() == 1:
        scale, zero = scale.reshape(()), zero.reshape(())
    return ((torch.round(x.float() * (1 / scale)) + zero).clamp(qmin, qmax) - zero).mul(scale).to(x.dtype)


def _reference_grid(self):
    return quantizers.qparams(self.lo, self.hi, self.spec.format, self.spec.symmetric)


def _run(name: str, dtype: torch.dtype, batches, ids):
    torch.manual_seed(0)
    model = qg.build("tiny-llama", seed=0, dtype=dtype).eval()
    needs = qg.quant.get_scheme(name).needs_calibration
    options: dict[str, Any] = {"calib": 2} if needs else {}
    q = qg.quantize(model, name, calibration=batches, **options)
    with torch.no_grad():
        logits = q(input_ids=ids).logits
    return q.state_dict(), logits


CASES = [(name, torch.float32) for name in SIMULATED + VARIANTS] + [
    (name, torch.bfloat16) for name in ("w8a8-int8-static", "w8a8-int8-bondarenko", "w8a8-int8-dynamic", "kv4-int4")
]  # bfloat16 takes the other branch of the integer round trip (a float32 copy, rounded in place)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_scheme_equals_its_unfused_reference(monkeypatch, name, dtype):
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(3, 500, (2, 32), generator=g)} for _ in range(2)]
    ids = torch.randint(3, 500, (2, 32), generator=g)
    state, logits = _run(name, dtype, batches, ids)
    with monkeypatch.context() as m:
        m.setattr(quantizers, "fake_int", _reference_fake_int)
        m.setattr(simulate.ActQuant, "_grid", _reference_grid)
        ref_state, ref_logits = _run(name, dtype, batches, ids)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(logits, ref_logits)
