"""``mpt_causal_lm`` with experts <-> ``transformers.DbrxForCausalLM``.

DBRX is an MPT with rotary positions, grouped-query attention, bias-free LayerNorms and an ``mb_dmoe``
feed-forward of SwiGLU experts: its parameter names are MPT's (``norm_attn_norm`` wraps the attention
half of a block). DBRX stores each expert matrix stacked along the rows, ``(experts * ffn, d_model)``:
``w1`` (gate) and ``v1`` (up) are foundry's (experts, ffn, d_model) viewed flat, and ``w2`` is the
transpose of foundry's down projection (experts, d_model, ffn).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import DbrxConfig

from foundry.convert.llama_moe import STACKED_EXPERTS, rotary_moe_checks, warn_unexported_training_settings
from foundry.convert.rope import hf_rope_settings
from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size

FAMILY = "mpt_causal_lm"
# foundry name -> DBRX name, per block (experts are reshaped, below)
_BLOCK_NAMES = {
    "norm_1.weight": "norm_attn_norm.norm_1.weight",
    "attn.Wqkv.weight": "norm_attn_norm.attn.Wqkv.weight",
    "attn.out_proj.weight": "norm_attn_norm.attn.out_proj.weight",
    "norm_2.weight": "norm_attn_norm.norm_2.weight",
    "ffn.router.layer.weight": "ffn.router.layer.weight",
}
_EXPERT_NAMES = {"ffn.experts.gate_proj": "ffn.experts.mlp.w1", "ffn.experts.up_proj": "ffn.experts.mlp.v1"}
_DOWN, _HF_DOWN = "ffn.experts.down_proj", "ffn.experts.mlp.w2"
_TOP_NAMES = ("transformer.wte.weight", "transformer.norm_f.weight", "lm_head.weight")
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)$")


def unmappable_features(config: Any) -> list[str]:
    """The settings of an ``MPTConfig`` that ``DbrxForCausalLM`` cannot compute (empty when it can)."""
    attn = config.attn_config
    checks = {
        **rotary_moe_checks(config),
        "attn_config.qk_ln / qk_gn": attn.qk_ln or attn.qk_gn,
        "norm_type (must be a layernorm)": "layernorm" not in config.norm_type,
        "norm_eps (must be 1e-5)": config.norm_eps != 1e-5,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attn_config.head_dim (must be d_model / n_heads)": config.head_dim_decoupled,
    }
    return [feature for feature, unmappable in checks.items() if unmappable]


def to_hf_config(model: Any) -> Any:
    """A ``transformers.DbrxConfig`` for an MPT with experts."""
    config, attn, ffn = model.config, model.config.attn_config, model.config.ffn_config
    rope = {"rope_parameters": {"rope_theta": float(attn.rope_theta), "rope_type": "default"}}
    warn_unexported_training_settings(config, "DbrxForCausalLM", exported=("moe_jitter_eps",))
    hf_config = DbrxConfig(
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        max_seq_len=config.max_seq_len,
        vocab_size=config.vocab_size,
        resid_pdrop=float(config.resid_pdrop),
        emb_pdrop=float(config.emb_pdrop),
        attn_config={
            "attn_pdrop": float(attn.attn_pdrop),
            "clip_qkv": attn.clip_qkv,
            "kv_n_heads": attn.resolve_kv_n_heads(config.n_heads),
            **({} if STACKED_EXPERTS else {"rope_theta": float(attn.rope_theta)}),
        },
        ffn_config={
            "ffn_act_fn": {"name": "silu"},
            "ffn_hidden_size": ffn_hidden_size(config.d_model, config.expansion_ratio, ffn),
            "moe_num_experts": ffn.moe_num_experts,
            "moe_top_k": ffn.moe_top_k,
            "moe_jitter_eps": ffn.moe_jitter_eps,
            "moe_loss_weight": float(ffn.moe_loss_weight),
            "moe_normalize_expert_weights": ffn.moe_normalize_expert_weights,
        },
        tie_word_embeddings=False,
        architectures=["DbrxForCausalLM"],
        **(rope if STACKED_EXPERTS else {}),
    )
    if STACKED_EXPERTS:  # transformers 5's DbrxAttention still reads attn_config.rope_theta
        hf_config.attn_config.rope_theta = float(attn.rope_theta)
    return hf_config


def to_hf_state_dict(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    del model
    hf_state = {}
    for name, tensor in state.items():
        match = _BLOCK.match(name)
        if name in _TOP_NAMES:
            hf_state[name] = tensor
        elif match and match.group(2) in _BLOCK_NAMES:
            hf_state[f"transformer.blocks.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"] = tensor
        elif match and match.group(2) in _EXPERT_NAMES:
            hf_state[f"transformer.blocks.{match.group(1)}.{_EXPERT_NAMES[match.group(2)]}"] = tensor.flatten(0, 1)
        elif match and match.group(2) == _DOWN:
            down = tensor.transpose(1, 2).flatten(0, 1).contiguous()  # (experts * ffn, d_model)
            hf_state[f"transformer.blocks.{match.group(1)}.{_HF_DOWN}"] = down
        else:
            raise ConfigError(f"DBRX export does not know the parameter '{name}'.")
    return hf_state


def from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The ``model:`` section of a foundry YAML (``mpt_causal_lm``) for a Hugging Face DBRX config."""
    attn, ffn = hf_config.attn_config, hf_config.ffn_config
    rope_theta = getattr(attn, "rope_theta", None) if not STACKED_EXPERTS else hf_rope_settings(hf_config)[0]
    kv_n_heads = attn.kv_n_heads
    act = dict(ffn.ffn_act_fn or {"name": "silu"})
    if act != {"name": "silu"}:
        raise ConfigError(
            f"This DBRX checkpoint's ffn_config.ffn_act_fn is {act}; foundry's DBRX import reads silu experts. Train "
            "it as `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}` instead."
        )
    return {
        "name": FAMILY,
        "d_model": hf_config.d_model,
        "n_heads": hf_config.n_heads,
        "n_layers": hf_config.n_layers,
        "max_seq_len": hf_config.max_seq_len,
        "vocab_size": hf_config.vocab_size,
        "resid_pdrop": float(hf_config.resid_pdrop),
        "emb_pdrop": float(hf_config.emb_pdrop),
        "learned_pos_emb": False,
        "no_bias": True,
        "norm_type": "layernorm",
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attn_config": {
            "attn_type": "multihead_attention" if kv_n_heads == hf_config.n_heads else "grouped_query_attention",
            **({} if kv_n_heads == hf_config.n_heads else {"kv_n_heads": kv_n_heads}),
            "attn_pdrop": float(attn.attn_pdrop),
            "clip_qkv": attn.clip_qkv,
            "rope": True,
            "rope_impl": "hf",
            "rope_theta": float(rope_theta or 10000.0),
        },
        "ffn_config": {
            "ffn_type": "mb_dmoe",
            "mlp_type": "glu",
            "ffn_act_fn": {"name": "silu"},
            "ffn_hidden_size": ffn.ffn_hidden_size,
            "moe_num_experts": ffn.moe_num_experts,
            "moe_top_k": ffn.moe_top_k,
            "moe_jitter_eps": ffn.moe_jitter_eps,
            "moe_loss_weight": float(ffn.moe_loss_weight),
            "moe_normalize_expert_weights": ffn.moe_normalize_expert_weights,
        },
    }


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    ffn = hf_config.ffn_config
    experts, width = ffn.moe_num_experts, ffn.ffn_hidden_size
    block_names = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
    expert_names = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
    state = {}
    for name, tensor in hf_state.items():
        match = _BLOCK.match(name)
        if name in _TOP_NAMES:
            state[name] = tensor
        elif match and match.group(2) in block_names:
            state[f"transformer.blocks.{match.group(1)}.{block_names[match.group(2)]}"] = tensor
        elif match and match.group(2) in expert_names:
            stacked = tensor.view(experts, width, -1)  # (experts, ffn, d_model)
            state[f"transformer.blocks.{match.group(1)}.{expert_names[match.group(2)]}"] = stacked
        elif match and match.group(2) == _HF_DOWN:
            down = tensor.view(experts, width, -1).transpose(1, 2).contiguous()  # (experts, d_model, ffn)
            state[f"transformer.blocks.{match.group(1)}.{_DOWN}"] = down
        elif not name.endswith("rotary_emb.inv_freq"):
            raise ConfigError(f"DBRX import does not know the parameter '{name}'.")
    return state
