"""Models: families, presets, the attention swap, build/save/load."""

from .families import FAMILIES, Family, family_of, get_family
from .io import build, load, save
from .presets import PRESETS, Preset
from .sources import PACKAGED, tokenizer
from .swap import apply_variant, attention_modules, gate_parameters, set_backend, variant_of

__all__ = [
    "FAMILIES",
    "Family",
    "family_of",
    "get_family",
    "build",
    "load",
    "save",
    "PRESETS",
    "Preset",
    "PACKAGED",
    "tokenizer",
    "apply_variant",
    "attention_modules",
    "gate_parameters",
    "set_backend",
    "variant_of",
]
