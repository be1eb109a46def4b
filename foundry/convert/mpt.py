"""foundry's MPT <-> ``transformers.MptForCausalLM``, where the features map (``foundry.convert.HF_FAMILIES``
writes the others as Llama, GPT-2 or foundry's own code).

Parameter names are the same on both sides. Hugging Face's MPT is narrower than LLM Foundry's: ALiBi
with ``alibi_bias_max`` 8, multi-head attention, no biases, a GELU MLP of width 4·d_model, tied
embeddings, no QK norm and no logit scale. An export outside that set fails naming the feature.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import MptConfig as HFMptConfig

from foundry.errors import ConfigError

FAMILY = "mpt_causal_lm"
_HF_ALIBI_BIAS_MAX = 8  # MptModel.forward builds ALiBi with the default, whatever the config says


def unmappable_features(config: Any) -> list[str]:
    """The settings of an ``MPTConfig`` that ``MptForCausalLM`` cannot express (empty when it maps)."""
    attn, ffn = config.attn_config, config.ffn_config
    checks = {
        "attn_config.alibi (must be true)": not attn.alibi,
        f"attn_config.alibi_bias_max (must be {_HF_ALIBI_BIAS_MAX})": attn.alibi_bias_max != _HF_ALIBI_BIAS_MAX,
        "attn_config.rope": attn.rope,
        "attn_config.attn_type (must be multihead_attention)": attn.attn_type != "multihead_attention",
        "attn_config.qk_ln / qk_gn": attn.qk_ln or attn.qk_gn,
        "attn_config.sliding_window_size": attn.sliding_window_size != -1,
        "attn_config.head_dim (must be d_model / n_heads)": config.head_dim_decoupled,
        "learned_pos_emb": config.learned_pos_emb,
        "no_bias (must be true)": not config.no_bias,
        "norm_type (must be layernorm or low_precision_layernorm)": "rmsnorm" in config.norm_type,
        "ffn_config.ffn_type (must be mptmlp)": ffn.ffn_type != "mptmlp",
        "ffn_config.ffn_act_fn (must be exact gelu)": (ffn.ffn_act_fn.name, ffn.ffn_act_fn.approximate)
        != ("gelu", "none"),
        "expansion_ratio / ffn_hidden_size (must give 4 * d_model)": _ffn_width(config) != 4 * config.d_model,
        "tie_word_embeddings (must be true)": not config.tie_word_embeddings,
        "logit_scale": config.logit_scale is not None,
    }
    return [feature for feature, unmappable in checks.items() if unmappable]


def _ffn_width(config: Any) -> float:
    return config.ffn_config.ffn_hidden_size or config.d_model * config.expansion_ratio


def to_hf_config(model: Any) -> Any:
    """A ``transformers.MptConfig`` for an ``MPTCausalLM``, or a ConfigError naming what does not map."""
    config = model.config
    unmappable = unmappable_features(config)
    if unmappable:
        raise ConfigError(
            "This MPT cannot be written as transformers' MptForCausalLM, which lacks: "
            f"model.{', model.'.join(unmappable)}. "
            "`foundry convert to-hf` writes such a model as the class that computes it (LlamaForCausalLM, "
            "GPT2LMHeadModel, or foundry's own code: docs/HF_INTEROP.md)."
        )
    attn = config.attn_config
    # transformers 5 validates types strictly: floats as floats, alibi_bias_max as an int. It types
    # attn_pdrop (MptForCausalLM's only dropout) as an int, so dropout is left at its default, 0.
    return HFMptConfig(
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        expansion_ratio=4,
        max_seq_len=config.max_seq_len,
        vocab_size=config.vocab_size,
        layer_norm_epsilon=float(config.norm_eps),
        learned_pos_emb=False,
        attn_config={
            "alibi": True,
            "alibi_bias_max": _HF_ALIBI_BIAS_MAX,
            "clip_qkv": _float_or_none(attn.clip_qkv),
            "softmax_scale": _float_or_none(attn.softmax_scale),
            "qk_ln": False,
        },
        no_bias=True,
        norm_type=config.norm_type,
        embedding_fraction=float(config.embedding_fraction),
        tie_word_embeddings=True,
        architectures=["MptForCausalLM"],
    )


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def to_hf_state_dict(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    del model
    return dict(state)


def from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The ``model:`` section of a foundry YAML for a Hugging Face MPT config.

    The section describes what ``MptForCausalLM`` computes; a config declaring a feature that class
    ignores (its weights were trained with LLM Foundry's own MPT code) fails, naming the feature.
    """
    attn = _attn_dict(hf_config)
    _check_hf_features(hf_config, attn)
    return {
        "name": FAMILY,
        "d_model": hf_config.d_model,
        "n_heads": hf_config.n_heads,
        "n_layers": hf_config.n_layers,
        "expansion_ratio": 4,
        "max_seq_len": hf_config.max_seq_len,
        "vocab_size": hf_config.vocab_size,
        "resid_pdrop": hf_config.resid_pdrop,
        "emb_pdrop": hf_config.emb_pdrop,
        "norm_eps": hf_config.layer_norm_epsilon,
        "learned_pos_emb": False,
        "no_bias": True,
        "norm_type": "low_precision_layernorm" if hf_config.norm_type == "low_precision_layernorm" else "layernorm",
        "attn_config": {
            "alibi": True,
            "alibi_bias_max": _HF_ALIBI_BIAS_MAX,
            "clip_qkv": attn.get("clip_qkv"),
            "softmax_scale": attn.get("softmax_scale"),
            "attn_pdrop": attn.get("attn_pdrop", 0.0),
        },
        "tie_word_embeddings": True,
    }


def _attn_dict(hf_config: Any) -> dict[str, Any]:
    attn = hf_config.attn_config
    return dict(attn) if isinstance(attn, dict) else attn.to_dict()


def _check_hf_features(hf_config: Any, attn: dict[str, Any]) -> None:
    attn_type = attn.get("attn_type", "multihead_attention")
    ignored_by_hf = {
        "no_bias: false": not getattr(hf_config, "no_bias", True),
        "attn_config.alibi: false": not attn.get("alibi", True),
        "attn_config.alibi_bias_max": attn.get("alibi_bias_max", _HF_ALIBI_BIAS_MAX) != _HF_ALIBI_BIAS_MAX,
        "attn_config.rope": attn.get("rope", False),
        "attn_config.qk_ln": attn.get("qk_ln", False),
        f"attn_config.attn_type: {attn_type}": attn_type != "multihead_attention",
        "expansion_ratio other than 4": getattr(hf_config, "expansion_ratio", 4) != 4,
        "logit_scale": getattr(hf_config, "logit_scale", None) is not None,
        "an rmsnorm norm_type": "rmsnorm" in str(getattr(hf_config, "norm_type", "")),
    }
    ignored = [feature for feature, is_set in ignored_by_hf.items() if is_set]
    if ignored:
        raise ConfigError(
            f"This MPT checkpoint's config sets {', '.join(ignored)}, which transformers' MptForCausalLM does not "
            "compute, so neither it nor a foundry import would run these weights as they were trained. Train it as "
            "`model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>, trust_remote_code: true}` if the "
            "checkpoint ships its own MPT code."
        )


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    del hf_config
    return {name: tensor for name, tensor in hf_state.items() if name != "lm_head.weight"}
