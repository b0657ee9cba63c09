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
from .errors import InputError, MissingDependency, MissingFile, QuantgateError, Unavailable
from .evaluate import Evaluation, evaluate
from .models import apply_variant, build, gate_parameters, set_backend, tokenizer, variant_of
from .observe import ObserveReport, observe
from .quant import SCHEMES, quant_error, quantization_of, quantize
from .study import run_study
from .train import TrainConfig, train
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
    "Evaluation",
    "TrainConfig",
    "train",
    "run_study",
    "audit",
    "Audit",
    "QuantgateError",
    "InputError",
    "MissingFile",
    "MissingDependency",
    "Unavailable",
    "__version__",
]
