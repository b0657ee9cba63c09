"""quantgate: will this transformer survive INT8/FP8 quantization, and does a gated attention help?

import quantgate as qg
model = qg.build("tiny-opt", variant="g1-headwise", seed=0)
qg.save(model, "run/model"); model = qg.load("run/model")
"""

from . import (
    _quiet,  # noqa: F401  (first, for its effect: it quiets dependencies' import-time logs)
    data,
)
from .attention import gated_sdpa
from .audit import Audit, audit
from .checkpoint import load, save
from .evaluate import evaluate
from .models import apply_variant, build, gate_parameters, set_backend, tokenizer, variant_of
from .observe import ObserveReport, observe
from .quant import SCHEMES, quant_error, quantization_of, quantize
from .variants import AttentionVariant

__version__ = "0.1.0"

__all__ = [
    "AttentionVariant",
    "gated_sdpa",
    "build",
    "load",
    "save",
    "apply_variant",
    "set_backend",
    "gate_parameters",
    "variant_of",
    "tokenizer",
    "data",
    "observe",
    "ObserveReport",
    "quantize",
    "quant_error",
    "quantization_of",
    "SCHEMES",
    "evaluate",
    "audit",
    "Audit",
    "__version__",
]
