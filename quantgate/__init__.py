"""quantgate: will this transformer survive INT8/FP8 quantization, and does a gated attention help?

import quantgate as qg
model = qg.build("tiny-opt", variant="g1-headwise", seed=0)
qg.save(model, "run/model"); model = qg.load("run/model")

The ``qg.*`` names are resolved at first use (lm-eval's pattern: a module ``__getattr__`` mapping each name to the
submodule that defines it), so importing one submodule (``quantgate.options``) loads that module and what it imports,
not torch models, transformers, lm-eval or the audit.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

from . import _quiet  # noqa: F401  (first, for its effect: it quiets dependencies' import-time logs)
from .errors import InputError, MissingDependency, MissingFile, QuantgateError, Unavailable

if TYPE_CHECKING:  # the names as __getattr__ gives them, for type checkers and editors
    from . import data
    from .attention import gated_sdpa
    from .audit import Audit, audit
    from .eval.evaluate import Evaluation, evaluate
    from .model_files import load, save
    from .models import apply_variant, build, gate_parameters, set_backend, tokenizer, variant_of
    from .observe import ObserveReport, observe
    from .quant import SCHEMES, quant_error, quantization_of, quantize
    from .study import run_study
    from .train import TrainConfig, train
    from .variants import AttentionVariant

__version__ = "0.1.0"

# each qg.* name and the submodule that defines it, imported at the name's first use
_API = {
    "AttentionVariant": ".variants",
    "gated_sdpa": ".attention",
    "build": ".models",
    "load": ".model_files",
    "save": ".model_files",
    "apply_variant": ".models",
    "set_backend": ".models",
    "gate_parameters": ".models",
    "variant_of": ".models",
    "tokenizer": ".models",
    "observe": ".observe",
    "ObserveReport": ".observe",
    "quantize": ".quant",
    "quant_error": ".quant",
    "quantization_of": ".quant",
    "SCHEMES": ".quant",
    "evaluate": ".eval.evaluate",
    "Evaluation": ".eval.evaluate",
    "TrainConfig": ".train",
    "train": ".train",
    "run_study": ".study",
    "audit": ".audit",
    "Audit": ".audit",
}
# verbs named as their submodule: importing the submodule must not replace the verb as qg.<name> (the submodule
# stays importable by name: importlib.import_module("quantgate.observe"))
_VERBS = frozenset({"observe", "train", "audit"})

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


def __getattr__(name: str) -> object:
    """``qg.<name>``: an API name from the submodule that defines it, or a submodule (``qg.quant``), imported now
    and kept."""
    if name in _API:
        value = getattr(importlib.import_module(_API[name], __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """quantgate's module object: a submodule named as a verb (``quantgate.observe``), once imported, leaves
    ``qg.observe`` the verb, as it was when this file imported every name at once."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _VERBS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
