"""Llama 2/3-style decoders and their mixtures of experts: ``model.name: llama_causal_lm``.

A Llama is a configuration of the same decoder as MPT, not a second implementation: RMSNorm
pre-norm blocks without biases, rotary embeddings (HF's half-split layout, optional Llama 3.1
long-context scaling), SwiGLU feed-forward with Llama's hidden-size rule, grouped-query attention
and an untied output head; with ``moe_num_experts``, each SwiGLU is a mixture of SwiGLU experts
(Mixtral, OLMoE with ``qk_norm: all_heads``, Qwen3-MoE with ``qk_norm: per_head``).
``LlamaConfig`` speaks Llama's vocabulary and becomes an ``MPTConfig``, so every kernel, algorithm
and sharding rule written for MPT serves Llama too, and ``foundry convert to-hf`` writes a
``LlamaForCausalLM`` (``MixtralForCausalLM``, ``OlmoeForCausalLM``, ``Qwen3MoeForCausalLM`` with experts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from foundry import registry
from foundry.errors import ConfigError
from foundry.models.attention import AttnConfig, AttnImpl, RopeHFConfig, check_rope_scaling
from foundry.models.init import InitConfig
from foundry.models.layers import ActFnConfig, FFNConfig, check_moe_keys
from foundry.models.lora import LoraConfig
from foundry.models.mpt import LossFn, MPTCausalLM, MPTConfig
from foundry.schema import parse_dataclass

_KEY = "model"
_ATTN_CONFIG_KEYS = ("attn_impl", "attn_pdrop", "attn_uses_sequence_id")


@dataclasses.dataclass
class RopeScalingConfig:
    """``model.rope_scaling``, as in a Hugging Face Llama ``config.json`` (transformers' semantics).

    ``llama3`` uses every key; ``linear`` only ``factor``.
    """

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        check_rope_scaling(
            self.rope_type, self.factor, self.low_freq_factor, self.high_freq_factor, f"{_KEY}.rope_scaling"
        )

    def to_rope_hf_config(self) -> RopeHFConfig:
        return RopeHFConfig(
            type=self.rope_type,
            factor=self.factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
        )


@dataclasses.dataclass
class LlamaConfig:
    """The ``model`` section of a Llama YAML; defaults are Llama-3-8B's."""

    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    kv_n_heads: int | None = 8  # None: as many as n_heads (plain multi-head attention)
    head_dim: int | None = None  # None: d_model / n_heads; Qwen3 sets 128 where d_model / n_heads is 64
    vocab_size: int = 128256
    max_seq_len: int = 8192
    ffn_hidden_size: int | None = None  # None: Llama's rule from multiple_of and ffn_dim_multiplier
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    norm_type: Literal["rmsnorm", "low_precision_rmsnorm"] = "rmsnorm"
    rope_theta: float = 500000.0
    rope_scaling: RopeScalingConfig | None = None
    attn_impl: AttnImpl = "sdpa"
    attn_pdrop: float = 0.0
    attn_uses_sequence_id: bool = False  # document masking for packed finetuning batches
    # MPT's spelling of the three keys above ({attn_impl: flash}), so one override serves both families
    attn_config: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    init_std: float = 0.02  # every linear and embedding weight ~ N(0, init_std), as Hugging Face's Llama
    # q and k normalised (RMSNorm) before RoPE: over all heads together (OLMoE) or per head (Qwen3)
    qk_norm: Literal["none", "all_heads", "per_head"] = "none"
    # Mixture of experts (Mixtral, OLMoE, Qwen3-MoE): each block's SwiGLU becomes moe_num_experts
    # SwiGLU experts ffn_hidden_size wide, moe_top_k per token (foundry/models/moe.py); None: dense.
    moe_num_experts: int | None = None
    moe_top_k: int = 2
    moe_normalize_expert_weights: float | None = 1.0  # top-k weights renormalised to sum 1 (null: OLMoE's raw)
    moe_shared_expert_hidden_size: int | None = None  # a SwiGLU every token also goes through
    moe_loss_weight: float = 0.01  # load-balancing loss weight (LLM Foundry's / MegaBlocks' formula)
    moe_zloss_weight: float = 0.0  # router z-loss weight
    init_device: str = "cpu"
    loss_fn: LossFn = "auto"  # as MPT's
    use_cache: bool = True  # as MPT's: greedy generation decodes with a KV cache
    peft_config: LoraConfig | None = None  # LoRA adapters on the linear layers it names (docs/LORA.md)
    activation_checkpointing_target: str | list[Any] | dict[str, Any] | None = None  # as MPTConfig's

    def __post_init__(self) -> None:
        self._take_attn_config()
        for key in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"'{_KEY}.{key}' is {getattr(self, key)}; it must be positive.")
        for key in ("ffn_hidden_size", "ffn_dim_multiplier", "norm_eps", "init_std", "rope_theta"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"'{_KEY}.{key}' is {value}; it must be positive.")
        if self.kv_n_heads is not None and (self.kv_n_heads <= 0 or self.n_heads % self.kv_n_heads):
            raise ConfigError(
                f"'{_KEY}.kv_n_heads' ({self.kv_n_heads}) must divide '{_KEY}.n_heads' ({self.n_heads}); "
                "each key/value head serves n_heads / kv_n_heads query heads."
            )
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            raise ConfigError(f"'{_KEY}.head_dim' is {self.head_dim}; it must be positive and even (RoPE turns pairs).")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"'{_KEY}.d_model' ({self.d_model}) must be divisible by '{_KEY}.n_heads' ({self.n_heads}): "
                f"each head gets d_model / n_heads dimensions, unless '{_KEY}.head_dim' sets the width."
            )
        if self.moe_num_experts is not None:
            check_moe_keys(self.moe_num_experts, self.moe_top_k, self.moe_normalize_expert_weights, f"{_KEY}.")

    def _take_attn_config(self) -> None:
        """Move ``attn_config``'s keys to their Llama spelling; a key set both ways must agree."""
        defaults = {key: LlamaConfig.__dataclass_fields__[key].default for key in _ATTN_CONFIG_KEYS}
        for key, value in (self.attn_config or {}).items():
            if key not in _ATTN_CONFIG_KEYS:
                raise ConfigError(
                    f"'{_KEY}.attn_config.{key}' is not a Llama key: a Llama's attention is set by its own keys "
                    f"(kv_n_heads, rope_theta, rope_scaling); attn_config takes {', '.join(_ATTN_CONFIG_KEYS)}. "
                    "Use model.name: mpt_causal_lm for MPT's attention options."
                )
            if getattr(self, key) not in (defaults[key], value):
                raise ConfigError(
                    f"'{_KEY}.{key}' is {getattr(self, key)!r} but '{_KEY}.attn_config.{key}' is {value!r}: they "
                    "are two spellings of one key. Keep one."
                )
            setattr(self, key, value)
        self.attn_config = None

    @property
    def hidden_size(self) -> int:
        """The SwiGLU width (HF's ``intermediate_size``; each expert's with MoE): ``ffn_hidden_size``, else Meta's rule.

        Meta's rule: 2/3 of 4 * d_model, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``.
        """
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        hidden = int(2 * 4 * self.d_model / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)  # ceil division

    def to_mpt_config(self) -> MPTConfig:
        """The same network as MPT keys: no biases, RMSNorm, RoPE, SwiGLU, N(0, init_std) init."""
        return MPTConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            max_seq_len=self.max_seq_len,
            vocab_size=self.vocab_size,
            learned_pos_emb=False,
            attn_config=self._attn_config(),
            ffn_config=self._ffn_config(),
            init_config=InitConfig(
                name="baseline_", init_std=self.init_std, emb_init_std=self.init_std, init_div_is_residual=False
            ),
            init_device=self.init_device,
            peft_config=self.peft_config,
            no_bias=True,
            norm_type=self.norm_type,
            norm_eps=self.norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            loss_fn=self.loss_fn,
            use_cache=self.use_cache,
            activation_checkpointing_target=self.activation_checkpointing_target,
        )

    def _ffn_config(self) -> FFNConfig:
        silu = ActFnConfig(name="silu")
        if self.moe_num_experts is None:
            return FFNConfig(ffn_type="mptglu", ffn_act_fn=silu, ffn_hidden_size=self.hidden_size)
        return FFNConfig(
            ffn_type="mb_dmoe",
            mlp_type="glu",
            ffn_act_fn=silu,
            ffn_hidden_size=self.hidden_size,
            moe_num_experts=self.moe_num_experts,
            moe_top_k=self.moe_top_k,
            moe_normalize_expert_weights=self.moe_normalize_expert_weights,
            shared_expert=self.moe_shared_expert_hidden_size is not None,
            shared_expert_hidden_size=self.moe_shared_expert_hidden_size,
            moe_loss_weight=self.moe_loss_weight,
            moe_zloss_weight=self.moe_zloss_weight,
        )

    def _attn_config(self) -> AttnConfig:
        kv_n_heads = self.kv_n_heads or self.n_heads
        is_multihead = kv_n_heads == self.n_heads
        return AttnConfig(
            attn_type="multihead_attention" if is_multihead else "grouped_query_attention",
            kv_n_heads=None if is_multihead else kv_n_heads,
            head_dim=self.head_dim,
            attn_impl=self.attn_impl,
            attn_pdrop=self.attn_pdrop,
            attn_uses_sequence_id=self.attn_uses_sequence_id,
            rope=True,
            rope_impl="hf",
            rope_theta=self.rope_theta,
            rope_hf_config=RopeHFConfig() if self.rope_scaling is None else self.rope_scaling.to_rope_hf_config(),
            qk_ln=self.qk_norm == "all_heads",
            qk_gn=self.qk_norm == "per_head",
        )


@registry.models.register("llama_causal_lm")
class LlamaCausalLM(MPTCausalLM):
    """A Llama as a next-token predictor; ``llama_config`` keeps the Llama-side keys (for export).

    Parameter names are MPT's (``transformer.blocks.N.attn.Wqkv`` holds q, k and v rows in that order);
    ``foundry convert to-hf`` maps them to Hugging Face's ``model.layers.N.self_attn.q_proj`` and so on.
    """

    def __init__(self, config: LlamaConfig | Mapping[str, Any] | None = None, **config_keys: Any) -> None:
        if config is not None and config_keys:
            raise ConfigError("Pass LlamaCausalLM either a LlamaConfig or its keys as keyword arguments, not both.")
        llama_config = parse_dataclass(LlamaConfig, config if config is not None else config_keys, _KEY)
        super().__init__(llama_config.to_mpt_config())
        self.llama_config = llama_config

    @classmethod
    def checked_config(cls, keys: Mapping[str, Any]) -> MPTConfig:
        """The network ``keys`` (a YAML's model section without ``name``) describe, as MPT keys, checked without
        building it (``foundry.models.build.checked_model_config``)."""
        return parse_dataclass(LlamaConfig, keys, _KEY).to_mpt_config()

    def constructor_config(self) -> LlamaConfig:
        return self.llama_config
