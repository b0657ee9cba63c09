"""Model families: where each transformers architecture keeps its attention.

A family is data: the transformers classes, and the paths (inside one block) of the module that
calls the attention function and of its projections. Swapping a variant in touches only those
modules, so pretrained weights load into gated models unchanged. The norms, residual branches and
embedding sum are data too: simulated quantization places its quantizers by them
(:mod:`quantgate.quant.simulate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict, cast

import torch
import torch.nn as nn
import transformers

from quantgate.errors import InputError

from ..attention.gates import AttentionDims
from ..registry import Registry

__all__ = [
    "Family",
    "FAMILIES",
    "DECODER_LAYOUT",
    "DecoderLayout",
    "GATED_MLP",
    "family_of",
    "get_family",
    "is_norm",
    "find_submodule",
    "config_of",
]


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a LayerNorm or RMSNorm of any family (transformers' own classes: LlamaRMSNorm,
    Qwen3NextRMSNormGated, ...; quantgate's UnitRMSNorm)."""
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "RMSNorm" in name or name.endswith("Norm")


def _qwen3_next_gate(q_out: torch.Tensor, dims: AttentionDims) -> torch.Tensor:
    """Qwen3-Next's built-in output gate from its q_proj output (B, N, H * 2 * D): the sigmoid of the second
    half of each head's slice, as (H, B * N * D) rows."""
    heads = q_out.view(*q_out.shape[:2], dims.n_heads, 2 * dims.head_dim)[..., dims.head_dim :]
    return torch.sigmoid(heads).permute(2, 0, 1, 3).reshape(dims.n_heads, -1)


@dataclass(frozen=True)
class TrainRecipe:
    """A family's optimiser recipe: the values TrainConfig's ``None`` fields take (quantgate.train)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    schedule: str


# The papers' optimiser settings (Bondarenko et al.: OPT lr 4e-4, AdamW(0.9, 0.95), wd 0.1; BERT lr 1e-4, linear
# decay, wd 0.01). Every family names its recipe: the causal families without a paper recipe of their own take
# OPT's, said in their rows; a family without one trains only with all four values given.
OPT_RECIPE = TrainRecipe(lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, schedule="cosine")
BERT_RECIPE = TrainRecipe(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, schedule="linear")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.model_type values
    config_cls: str  # transformers class names
    model_cls: str  # the default head for building from scratch
    objective: str  # "clm" or "mlm"
    layers: str  # path from model.base_model to the ModuleList of blocks
    attention: str  # path in a block to the module that calls the attention function
    q_proj: str
    v_proj: str
    o_proj: str
    ffn: str  # path in a block to the module whose output is the feed-forward output
    native_gate: str | None = None  # a gate the architecture has built in
    # its values per head from the q_proj output, (B, N, q_proj features) -> (heads, values)
    native_gate_values: Callable[[torch.Tensor, AttentionDims], torch.Tensor] | None = None
    v_head_dim: str | None = None  # config field of the value head dim where it differs from q/k's (MLA)
    value_gate: bool = True  # whether a G2 gate on v_proj's output can be expressed
    learned_positions: bool = False  # a position-embedding table: sequences longer than it cannot run
    # where the residual stream is formed (paths in a block unless said otherwise; a path a block lacks,
    # as in hybrid or MoE layers, is skipped there):
    attn_norm: str = "input_layernorm"  # norm before the attention (pre-norm) or after its residual sum (post)
    ffn_norm: str = "post_attention_layernorm"  # the same for the feed-forward
    pre_norm: bool | str = True  # False: norms take the residual sums (BERT); a str: the config flag saying it
    branches: tuple[str, ...] = ("self_attn.o_proj", "mlp")  # modules whose outputs the residual sums add
    inner_inputs: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # Linears fed by elementwise ops
    embed_sum: str | None = None  # from model.base_model: the module whose input is the sum of embeddings
    outer_outputs: tuple[str, ...] = ("norm",)  # from model.base_model: outputs around the blocks (final norm)
    final_norm: str | None = "norm"  # from model.base_model: the norm after the last block (post-LN BERT: none)
    position_table: str | None = None  # from model.base_model: a learned position table added to the embeddings
    # the FFN's Linears, for the fixes that fold into them (SmoothQuant, the rotation): those reading the FFN
    # norm, the one whose output rows scale the output Linear's input channels (act(gate) * up is linear in
    # up; ReLU(fc1) is positively homogeneous), and the output Linear; None: not known for this family
    ffn_linears: tuple[tuple[str, ...], str, str] | None = None
    # paths in the attention module of the Linears that read the normed stream (what SmoothQuant and the
    # rotation fold into)
    attn_inputs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    no_rotation: str | None = None  # why a Hadamard rotation cannot be folded into this family, if it cannot
    head: str | None = None  # from the model: the task head (default: the output embeddings)
    recipe: TrainRecipe | None = None  # how to train it from scratch (OPT_RECIPE, BERT_RECIPE); None: not known

    def config_class(self) -> type[transformers.PreTrainedConfig]:
        return getattr(transformers, self.config_cls)

    def model_class(self, config: transformers.PreTrainedConfig | None = None) -> type[transformers.PreTrainedModel]:
        """The checkpoint's own architecture when it belongs to this family, else the default."""
        for arch in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, arch, None)
            if cls is not None and arch.startswith(self.model_cls.split("For")[0]):
                return cls
        return getattr(transformers, self.model_cls)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(cast(nn.ModuleList, _base_model(model).get_submodule(self.layers)))

    def final_norm_of(self, model: nn.Module) -> nn.Module | None:
        """The norm after the last block, or None where the family or this model has none (OPT-350m's
        post-LN layout, BERT)."""
        return find_submodule(_base_model(model), self.final_norm) if self.final_norm else None

    def masked_lm_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A masked LM's loss computing vocabulary logits only at the masked positions (~7x less work for small
        models than the head's logits at every position; the same value). Other models: their own loss."""
        if self.objective != "mlm" or self.head is None:
            return model(**batch).loss
        hidden = _base_model(model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        picked = batch["labels"] != -100
        logits = model.get_submodule(self.head)(hidden.last_hidden_state[picked])
        return nn.functional.cross_entropy(logits.float(), batch["labels"][picked])

    def attention_blocks(self, model: nn.Module) -> list[nn.Module]:
        """Blocks that hold softmax attention (hybrid models also have linear-attention blocks)."""
        return [b for b in self.blocks(model) if _has(b, self.attention)]

    def dims(self, config: transformers.PreTrainedConfig) -> AttentionDims:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if self.v_head_dim:  # gates multiply the attention output: its head dim is the values'
            head_dim = getattr(config, self.v_head_dim)
        kv = getattr(config, "num_key_value_heads", None) or heads
        return AttentionDims(config.hidden_size, heads, kv, head_dim)

    def is_pre_norm(self, config: transformers.PreTrainedConfig) -> bool:
        return bool(getattr(config, self.pre_norm)) if isinstance(self.pre_norm, str) else self.pre_norm

    def check_seq_len(self, config: transformers.PreTrainedConfig, seq_len: int) -> None:
        """Raise ValueError when ``seq_len`` tokens do not fit the model's positions (learned tables only:
        RoPE models run past ``max_position_embeddings``, though beyond what they were trained on)."""
        limit = getattr(config, "max_position_embeddings", None) if self.learned_positions else None
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise InputError(f"seq_len must be a positive number of tokens, got {seq_len!r}")
        if limit is not None and seq_len > limit:
            raise InputError(
                f"seq_len {seq_len} is longer than this {self.name} model's {limit} positions "
                f"(max_position_embeddings); use --seq-len {limit} or less"
            )

    @staticmethod
    def init_std(config: transformers.PreTrainedConfig) -> float:
        std = getattr(config, "initializer_range", None)
        return float(std if std else getattr(config, "init_std", 0.02))


def config_of(model: nn.Module) -> transformers.PreTrainedConfig:
    """``model.config``, typed (nn.Module types its attributes loosely)."""
    return cast(transformers.PreTrainedConfig, model.config)


def _base_model(model: nn.Module) -> nn.Module:
    """``model.base_model`` (the transformer without its task head); nn.Module types attributes loosely."""
    return cast(nn.Module, model.base_model)


def find_submodule(owner: nn.Module, path: str) -> nn.Module | None:
    """``owner.get_submodule(path)``, or None where it has no such module."""
    try:
        return owner.get_submodule(path)
    except AttributeError:
        return None


def _has(module: nn.Module, path: str) -> bool:
    return find_submodule(module, path) is not None


class DecoderLayout(TypedDict):
    layers: str
    attention: str
    q_proj: str
    v_proj: str
    o_proj: str
    ffn: str
    objective: str
    recipe: TrainRecipe


DECODER_LAYOUT: DecoderLayout = {
    "layers": "layers",
    "attention": "self_attn",
    "q_proj": "self_attn.q_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "ffn": "mlp",
    "objective": "clm",
    "recipe": OPT_RECIPE,  # no paper recipe of their own: OPT's
}

GATED_MLP = (("mlp.gate_proj", "mlp.up_proj"), "mlp.up_proj", "mlp.down_proj")  # act(gate) * up -> down

FAMILIES: Registry[str, Family] = Registry.named(
    "model family",
    (
        Family(
            "bert",
            ("bert",),
            "BertConfig",
            "BertForMaskedLM",
            "mlm",
            "encoder.layer",
            "attention.self",
            "attention.self.query",
            "attention.self.value",
            "attention.output.dense",
            "output.dense",
            learned_positions=True,
            attn_norm="attention.output.LayerNorm",
            ffn_norm="output.LayerNorm",
            pre_norm=False,
            branches=("attention.output.dense", "output.dense"),
            inner_inputs=("attention.output.dense", "output.dense"),
            embed_sum="embeddings.LayerNorm",
            outer_outputs=("embeddings.LayerNorm",),
            final_norm=None,
            position_table="embeddings.position_embeddings",
            head="cls",
            recipe=BERT_RECIPE,
            attn_inputs=("query", "key", "value"),
            no_rotation="post-LN: its LayerNorms read the residual sums, so no norm sits between the stream and "
            "its readers",
        ),
        Family(
            "opt",
            ("opt",),
            "OPTConfig",
            "OPTForCausalLM",
            "clm",
            "decoder.layers",
            "self_attn",
            "self_attn.q_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "fc2",
            learned_positions=True,
            attn_norm="self_attn_layer_norm",
            ffn_norm="final_layer_norm",
            pre_norm="do_layer_norm_before",
            branches=("self_attn.out_proj", "fc2"),
            inner_inputs=("self_attn.out_proj", "fc2"),
            embed_sum="decoder.layers.0",
            outer_outputs=("decoder.final_layer_norm", "decoder.project_out"),
            final_norm="decoder.final_layer_norm",
            position_table="decoder.embed_positions",
            ffn_linears=(("fc1",), "fc1", "fc2"),
            recipe=OPT_RECIPE,
        ),
        Family("llama", ("llama",), "LlamaConfig", "LlamaForCausalLM", **DECODER_LAYOUT, ffn_linears=GATED_MLP),
        Family("qwen2", ("qwen2",), "Qwen2Config", "Qwen2ForCausalLM", **DECODER_LAYOUT, ffn_linears=GATED_MLP),
        Family("qwen3", ("qwen3",), "Qwen3Config", "Qwen3ForCausalLM", **DECODER_LAYOUT, ffn_linears=GATED_MLP),
        Family(
            "qwen3-next",
            ("qwen3_next",),
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            **DECODER_LAYOUT,
            native_gate="g1-elementwise",
            native_gate_values=_qwen3_next_gate,
            branches=("self_attn.o_proj", "linear_attn.out_proj", "mlp"),
            inner_inputs=(
                "self_attn.o_proj",
                "linear_attn.out_proj",
                "mlp.down_proj",
                "mlp.shared_expert.down_proj",
            ),
            no_rotation="linear-attention blocks and zero-centred (1 + w) norms are not handled",
        ),
        # DeepSeek-V3 multi-head latent attention: queries and keys/values through low-rank latents
        # (q_a/q_b, kv_a_proj_with_mqa/kv_b_proj), decoupled RoPE dims, q/k head dim != v head dim
        Family(
            "mla",
            ("deepseek_v3",),
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            "clm",
            "layers",
            "self_attn",
            "self_attn.q_b_proj",
            "self_attn.kv_b_proj",
            "self_attn.o_proj",
            "mlp",
            v_head_dim="v_head_dim",
            value_gate=False,
            recipe=OPT_RECIPE,  # no paper recipe of its own: OPT's
            attn_inputs=("q_a_proj", "kv_a_proj_with_mqa"),
            no_rotation="the attention reads the stream through latent projections with their own norms inside "
            "the attention",
            inner_inputs=(
                "self_attn.q_b_proj",
                "self_attn.kv_b_proj",
                "self_attn.o_proj",
                "mlp.down_proj",
                "mlp.shared_experts.down_proj",
            ),
        ),
    ),
    listing="supported",
)


def get_family(name: str) -> Family:
    return FAMILIES.lookup(name)


def family_of(model_or_config: nn.Module | transformers.PreTrainedConfig) -> Family:
    """The family of a transformers model or config, by ``config.model_type``."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    known = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values())
    raise InputError(f"model type {model_type!r} is not supported; quantgate families: {known}")
