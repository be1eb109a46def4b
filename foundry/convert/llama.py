"""foundry's Llama family, and any MPT that is a Llama in MPT's keys <-> ``transformers.LlamaForCausalLM``.

Names differ only in spelling, except that foundry fuses q, k and v into one ``Wqkv`` projection
(rows q, then k, then v), which is split for Hugging Face. Both use the half-split RoPE layout, so no
row permutation is needed.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import LlamaConfig as HFLlamaConfig

from foundry.convert.rope import hf_rope_scaling, hf_rope_settings
from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size

FAMILY = "llama_causal_lm"
# foundry suffix -> Hugging Face suffix, per block
_BLOCK_NAMES = {
    "norm_1.weight": "input_layernorm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "norm_2.weight": "post_attention_layernorm.weight",
    "ffn.gate_proj.weight": "mlp.gate_proj.weight",
    "ffn.up_proj.weight": "mlp.up_proj.weight",
    "ffn.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.norm_f.weight": "model.norm.weight"}
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_QKV = re.compile(r"^self_attn\.([qkv])_proj\.weight$")


def unmappable_features(config: Any) -> list[str]:
    """The settings of an ``MPTConfig`` that ``LlamaForCausalLM`` cannot compute (empty when it can).

    A ``llama_causal_lm`` always maps; an ``mpt_causal_lm`` maps when it is a Llama in MPT's keys.
    """
    attn, ffn = config.attn_config, config.ffn_config
    checks = {
        "attn_config.rope (must be true)": not attn.rope,
        # DAIL's rotary positions ignore left padding; transformers' Llama counts from each row's first token
        "attn_config.rope_impl (must be hf)": attn.rope_impl != "hf",
        "attn_config.alibi": attn.alibi,
        "learned_pos_emb": config.learned_pos_emb,
        "attn_config.qk_ln / qk_gn": attn.qk_ln or attn.qk_gn,
        "attn_config.clip_qkv": attn.clip_qkv is not None,
        "attn_config.softmax_scale": attn.softmax_scale is not None,
        "attn_config.sliding_window_size": attn.sliding_window_size != -1,
        "no_bias (must be true)": not config.no_bias,
        "norm_type (must be an rmsnorm)": "rmsnorm" not in config.norm_type,
        "ffn_config.ffn_type (must be mptglu)": ffn.ffn_type != "mptglu",
        "ffn_config.ffn_act_fn (must be silu)": ffn.ffn_act_fn.name != "silu",
        "logit_scale": config.logit_scale is not None,
    }
    return [feature for feature, unmappable in checks.items() if unmappable]


def to_hf_config(model: Any) -> Any:
    """A ``transformers.LlamaConfig`` for a ``LlamaCausalLM``, or an MPT that is a Llama."""
    config, attn = model.config, model.config.attn_config
    # Floats cast explicitly: transformers 5 validates config types strictly (a YAML `1` is an int).
    return HFLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=ffn_hidden_size(config.d_model, config.expansion_ratio, config.ffn_config),
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=attn.resolve_kv_n_heads(config.n_heads),
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=float(config.norm_eps),
        rope_theta=float(attn.rope_theta),
        rope_scaling=hf_rope_scaling(attn.rope_hf_config),
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=float(attn.attn_pdrop),
        initializer_range=float(config.init_config.init_std or 0.02),
        architectures=["LlamaForCausalLM"],
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    config = model.config
    q_dim, kv_dim = config.q_dim, config.attn_config.resolve_kv_n_heads(config.n_heads) * config.head_dim
    hf_state = {}
    for name, tensor in state.items():
        if name in _TOP_NAMES:
            hf_state[_TOP_NAMES[name]] = tensor
        elif name == "lm_head.weight":
            hf_state[name] = tensor
        elif match := _BLOCK.match(name):
            layer, suffix = match.groups()
            prefix = f"model.layers.{layer}."
            if suffix == "attn.Wqkv.weight":
                # Clones, not views: safetensors refuses tensors that share memory.
                q, k, v = (part.clone() for part in tensor.split([q_dim, kv_dim, kv_dim], dim=0))
                hf_state.update({f"{prefix}self_attn.{n}_proj.weight": w for n, w in zip("qkv", (q, k, v))})
            else:
                hf_state[prefix + _BLOCK_NAMES[suffix]] = tensor
        else:
            raise ConfigError(f"Llama export does not know the parameter '{name}'.")
    return hf_state


def from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The ``model:`` section of a foundry YAML for a Hugging Face Llama config."""
    _check_hf_features(hf_config)
    rope_theta, rope_scaling = hf_rope_settings(hf_config)
    section: dict[str, Any] = {
        "name": FAMILY,
        "d_model": hf_config.hidden_size,
        "n_layers": hf_config.num_hidden_layers,
        "n_heads": hf_config.num_attention_heads,
        "kv_n_heads": hf_config.num_key_value_heads or hf_config.num_attention_heads,
        "head_dim": _decoupled_head_dim(hf_config),
        "vocab_size": hf_config.vocab_size,
        "max_seq_len": hf_config.max_position_embeddings,
        "ffn_hidden_size": hf_config.intermediate_size,
        "norm_eps": hf_config.rms_norm_eps,
        "rope_theta": rope_theta,
        "tie_word_embeddings": bool(hf_config.tie_word_embeddings),
        "attn_pdrop": float(getattr(hf_config, "attention_dropout", 0.0)),
        "init_std": hf_config.initializer_range,
    }
    if rope_scaling is not None:
        section["rope_scaling"] = rope_scaling
    return section


def _decoupled_head_dim(hf_config: Any) -> int | None:
    """The config's ``head_dim`` where heads × head_dim is not hidden_size (Qwen3's), else None (foundry's default)."""
    head_dim = getattr(hf_config, "head_dim", None)
    tied = head_dim is None or head_dim * hf_config.num_attention_heads == hf_config.hidden_size
    return None if tied else head_dim


def _check_hf_features(hf_config: Any) -> None:
    problems = {
        "attention_bias": getattr(hf_config, "attention_bias", False),
        "mlp_bias": getattr(hf_config, "mlp_bias", False),
        "hidden_act": hf_config.hidden_act != "silu",
    }
    for key, unsupported in problems.items():
        if unsupported:
            raise ConfigError(
                f"This Llama checkpoint sets '{key}' to {getattr(hf_config, key)!r}, which foundry's Llama does not "
                "implement; train it as `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}` instead."
            )


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    top = {hf: ours for ours, hf in _TOP_NAMES.items()}
    block = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
    state: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        if name in top:
            state[top[name]] = tensor
        elif name == "lm_head.weight":
            if not hf_config.tie_word_embeddings:
                state[name] = tensor
        elif match := _HF_BLOCK.match(name):
            layer, suffix = match.groups()
            if qkv_match := _HF_QKV.match(suffix):
                qkv.setdefault(layer, {})[qkv_match.group(1)] = tensor
            elif suffix in block:
                state[f"transformer.blocks.{layer}.{block[suffix]}"] = tensor
            elif not suffix.endswith("rotary_emb.inv_freq"):
                raise ConfigError(f"Llama import does not know the parameter '{name}'.")
        elif not name.endswith("rotary_emb.inv_freq"):
            raise ConfigError(f"Llama import does not know the parameter '{name}'.")
    for layer, parts in qkv.items():
        if missing := [f"model.layers.{layer}.self_attn.{n}_proj.weight" for n in "qkv" if n not in parts]:
            raise ConfigError(
                f"The Llama checkpoint has no {', '.join(missing)}: layer {layer}'s attention needs its q, k and v "
                "projections. The checkpoint is incomplete (a shard missing from the folder, or an index that "
                "names a file not downloaded): download it again."
            )
        state[f"transformer.blocks.{layer}.attn.Wqkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return state
