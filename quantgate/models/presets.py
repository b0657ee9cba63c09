"""Named model sizes, built from config alone (no download).

``tiny-*`` run a forward pass in milliseconds on a CPU (tests, smoke runs); ``small-*`` train at a
few thousand tokens/s on two CPU cores; the published shapes match the checkpoints of the same
name (weights come from :func:`quantgate.load`). Tiny and small presets use the bundled 8192-token
tokenizers' special-token ids: <pad>=0, <s>=1, </s>=2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from ..errors import InputError
from ..options import ABOVE_0, AT_LEAST_1, Range, check_range
from ..registry import Registry
from .families import get_family

__all__ = ["Preset", "PRESETS", "decoder_config", "get_preset", "preset_config"]

SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class Preset:
    family: str
    config: dict = field(default_factory=dict)
    description: str = ""
    tokenizer: str = "bpe-8192"  # bundled tokenizer, packaged model or hub id whose tokenizer fits


def _shape(d: int, layers: int, heads: int, vocab: int, pos: int, **kw: object) -> dict[str, object]:
    """What every family's config names alike: width, depth, heads, vocabulary and positions."""
    shape = {"hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads, "vocab_size": vocab}
    return {**shape, "max_position_embeddings": pos, **kw}


def _bert(d: int, layers: int, heads: int, ffn: int, vocab: int = 8192, pos: int = 1024, **kw: object) -> dict:
    return _shape(d, layers, heads, vocab, pos, intermediate_size=ffn, pad_token_id=0, **kw)


def _opt(d: int, layers: int, heads: int, ffn: int, vocab: int = 8192, pos: int = 2048, **kw: object) -> dict:
    opt = {"ffn_dim": ffn, "word_embed_proj_dim": d, "do_layer_norm_before": True}
    return _shape(d, layers, heads, vocab, pos, **opt, **{**SPECIAL, **kw})


def decoder_config(
    d: int, layers: int, heads: int, kv: int, ffn: int, vocab: int = 8192, pos: int = 8192, **kw: object
) -> dict:
    decoder = {"num_key_value_heads": kv, "intermediate_size": ffn, "tie_word_embeddings": True}
    return _shape(d, layers, heads, vocab, pos, **decoder, **{**SPECIAL, **kw})


def _qwen3_next(d, layers, heads, kv, ffn, head_dim, **kw):
    cfg = decoder_config(d, layers, heads, kv, ffn, head_dim=head_dim, **kw)
    cfg.update(
        layer_types=["full_attention"] * layers,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=ffn // 2,
        shared_expert_intermediate_size=ffn // 2,
        decoder_sparse_step=1,
    )
    return cfg


def _mla(d, layers, heads, ffn, q_rank, kv_rank, nope, rope, v, **kw):
    """DeepSeek-V3-style MLA, dense (every layer an MLP, no MoE)."""
    cfg = decoder_config(d, layers, heads, heads, ffn, **kw)
    cfg.update(
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        first_k_dense_replace=layers,
        moe_intermediate_size=ffn // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    return cfg


# the published checkpoints' own settings beside their shapes
_QWEN3_06B: dict[str, Any] = {"vocab": 151936, "pos": 40960, "head_dim": 128, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
_QWEN3_06B |= {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": None}
_SMOLLM2: dict[str, Any] = {"vocab": 49152, "pos": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
_SMOLLM2 |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

PRESETS: Registry[str, Preset] = Registry(
    "preset",
    {
        "tiny-bert": Preset("bert", _bert(64, 2, 4, 128), "2 layers, d=64, 4 heads (CPU tests)", "wordpiece-8192"),
        "tiny-opt": Preset("opt", _opt(64, 2, 4, 128), "2 layers, d=64, 4 heads, pre-LN (CPU tests)"),
        "tiny-llama": Preset("llama", decoder_config(64, 2, 4, 2, 128), "2 layers, d=64, 4 q / 2 kv heads (CPU tests)"),
        "tiny-qwen3": Preset(
            "qwen3", decoder_config(64, 2, 4, 2, 128, head_dim=16), "2 layers, d=64, GQA 4/2, QK-norm"
        ),
        "tiny-qwen2": Preset("qwen2", decoder_config(64, 2, 4, 2, 128), "2 layers, d=64, GQA 4/2, qkv bias"),
        "tiny-qwen3-next": Preset(
            "qwen3-next",
            _qwen3_next(64, 2, 4, 2, 128, head_dim=16),
            "2 full-attention layers, d=64, built-in gate, 4 experts",
        ),
        "tiny-mla": Preset(
            "mla",
            _mla(64, 2, 4, 128, q_rank=32, kv_rank=32, nope=16, rope=8, v=16),
            "2 layers, d=64, 4 heads, MLA latents q 32 / kv 32, q/k head 16+8 rope, v head 16",
        ),
        "small-bert": Preset("bert", _bert(256, 4, 4, 1024), "4 layers, d=256 (CPU training)", "wordpiece-8192"),
        "small-opt": Preset("opt", _opt(256, 4, 4, 1024), "4 layers, d=256, pre-LN (CPU training)"),
        "small-llama": Preset("llama", decoder_config(256, 4, 4, 2, 768), "4 layers, d=256, GQA 4/2 (CPU training)"),
        "small-qwen3": Preset(
            "qwen3", decoder_config(256, 4, 4, 2, 768, head_dim=64), "4 layers, d=256, GQA 4/2, QK-norm"
        ),
        "small-mla": Preset(
            "mla",
            _mla(256, 4, 4, 768, q_rank=128, kv_rank=64, nope=48, rope=16, v=64),
            "4 layers, d=256, 4 heads, MLA latents q 128 / kv 64, q/k head 48+16 rope, v head 64",
        ),
        "bert-base": Preset(
            "bert",
            _bert(768, 12, 12, 3072, vocab=30522, pos=512, type_vocab_size=2),
            "BERT-base shape (110M)",
            "google-bert/bert-base-uncased",
        ),
        "opt-125m": Preset(
            "opt",
            _opt(
                768, 12, 12, 3072, vocab=50272, pos=2048, pad_token_id=1, bos_token_id=2, eos_token_id=2, init_std=0.006
            ),
            "OPT-125m shape; init std 0.006 as Bondarenko",
            "facebook/opt-125m",
        ),
        "qwen3-0.6b": Preset(
            "qwen3", decoder_config(1024, 28, 16, 8, 3072, **_QWEN3_06B), "Qwen3-0.6B shape", "Qwen/Qwen3-0.6B"
        ),
        "smollm2-135m": Preset(
            "llama",
            decoder_config(576, 30, 9, 3, 1536, **_SMOLLM2),
            "SmolLM2-135M shape (Llama, 30 layers)",
            "smollm2-135m",
        ),
    },
)


def get_preset(name: str) -> Preset:
    return PRESETS.lookup(name)


def preset_config(name: str, overrides: Mapping[str, object] | None = None) -> PreTrainedConfig:
    """The transformers config of preset ``name`` with ``overrides`` applied. An override must name a
    field of the family's config class and have its type (an int where an int is expected; a float
    field takes an int too); anything else is a ValueError listing the valid fields."""
    preset = get_preset(name)
    cls = get_family(preset.family).config_class()
    defaults = {**cls().to_dict(), **preset.config}
    for key, value in (overrides or {}).items():
        if key not in defaults or key.startswith("_") or key in ("model_type", "transformers_version"):
            valid = ", ".join(sorted(k for k in defaults if not k.startswith("_")))
            raise InputError(
                f"{name}: {key!r} is not a {cls.__name__} field (training settings such as lr or "
                f"steps are options of their own, e.g. --lr); valid: {valid}"
            )
        expected = defaults[key]
        if expected is not None and not _same_type(value, expected):
            raise InputError(f"{name}: {key} expects {type(expected).__name__} (default {expected!r}), got {value!r}")
    check_config_values(name, overrides or {})
    _check_heads(name, {**preset.config, **(overrides or {})}, {**defaults, **preset.config, **(overrides or {})})
    try:
        return cls(**{**preset.config, **(overrides or {})})
    except (StrictDataclassError, ValueError, TypeError) as e:  # the config class's own checks
        raise InputError(f"{name}: {' '.join(str(e).split())}") from None


# The values a config override may take, by field name: the ones whose wrong value fails late or silently
# (a model without layers, a NaN loss from a negative eps, a KeyError deep in the model for an unknown
# activation). Any float must be finite. Shared by qg.build, ``train --config`` and a study's ``config:``.
CONFIG_RANGES: list[tuple[str, Range]] = [
    (
        r"num_hidden_layers|num_attention_heads|num_key_value_heads|hidden_size|\w*intermediate_size|ffn_dim"
        r"|\w*vocab_size|max_position_embeddings|\w*head_dim|word_embed_proj_dim|\w+_lora_rank",
        AT_LEAST_1,
    ),
    (r"\w+_eps", ABOVE_0),
    (r"initializer_range|init_std", Range(lambda x: 0 < x <= 1, "in (0, 1] (a weight's initial standard deviation)")),
    (r"\w*dropout\w*", Range(lambda x: 0 <= x < 1, "a probability in [0, 1)")),
    (r"hidden_act|activation_function", Range(lambda x: x in ACT2FN, f"one of {', '.join(sorted(ACT2FN))}")),
]


def check_config_values(name: str, values: Mapping[str, object], *, heads: bool = False) -> None:
    """Raise a one-line InputError (``{name}: {field} must be ...``) for a config field of ``values`` outside
    its range (:data:`CONFIG_RANGES`; any other float must be finite; None and non-scalar values pass);
    ``heads``: also the head split (:func:`_check_heads`, for a whole config such as a checkpoint's config.json)."""
    for key, value in values.items():
        valid = next((r for pat, r in CONFIG_RANGES if re.fullmatch(pat, key)), None)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # floats: finite, at least
            check_range(f"{name}: {key}", value, valid)
    if heads:
        _check_heads(name, values, values)


def _check_heads(name: str, given: Mapping[str, object], config: Mapping[str, object]) -> None:
    """The attention heads split the width: hidden_size a multiple of num_attention_heads (where the head
    size is not ``given``; MLA's latent attention has its own head sizes), and those a multiple of
    num_key_value_heads (each key/value head serves a group of query heads)."""
    heads, kv, hidden = (config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if not isinstance(heads, int) or heads < 1 or "kv_lora_rank" in config:
        return
    if given.get("head_dim") is None and isinstance(hidden, int) and hidden % heads:
        raise InputError(
            f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (each head takes "
            f"hidden_size / num_attention_heads channels); change one of them"
        )
    if isinstance(kv, int) and kv >= 1 and heads % kv:
        raise InputError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} (each key/value "
            f"head serves a group of query heads); change one of them"
        )


def _same_type(value, expected) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool)
    if isinstance(expected, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(expected))
