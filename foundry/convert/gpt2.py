"""foundry's MPT with learned positions <-> ``transformers.GPT2LMHeadModel``, an exact equivalent.

An MPT with learned position embeddings, LayerNorm, a plain MLP and multi-head attention (LLM Foundry's
default MPT, and every shipped MPT pretrain YAML) computes what GPT-2 computes: the same embeddings, the
same pre-norm blocks, fused q/k/v rows in the same order. GPT-2 stores its linear layers as ``Conv1D``
(weights transposed, always with a bias); an MPT with ``no_bias: true`` is written with zero biases,
which add exact zeros. Logits agree within float rounding (``tests/convert/test_convert_gpt2.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import GPT2Config

from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size

FAMILY = "mpt_causal_lm"
# foundry activation (name, approximate) <-> GPT-2's activation_function
_ACTIVATIONS = {("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_pytorch_tanh", ("relu", "none"): "relu",
                ("silu", "none"): "silu"}  # fmt: skip
# foundry suffix -> GPT-2 suffix, per block; the Conv1D weights are transposed
_BLOCK_NAMES = {
    "norm_1": "ln_1", "attn.Wqkv": "attn.c_attn", "attn.out_proj": "attn.c_proj", "norm_2": "ln_2",
    "ffn.up_proj": "mlp.c_fc", "ffn.down_proj": "mlp.c_proj",
}  # fmt: skip
_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
_TOP_NAMES = {"transformer.wte": "transformer.wte", "transformer.wpe": "transformer.wpe",
              "transformer.norm_f": "transformer.ln_f", "lm_head": "lm_head"}  # fmt: skip
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)\.(weight|bias)$")
_HF_BLOCK = re.compile(r"^transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")
_HF_MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")  # older transformers' causal mask


def unmappable_features(config: Any) -> list[str]:
    """The settings of an ``MPTConfig`` that ``GPT2LMHeadModel`` cannot compute (empty when it can)."""
    attn, ffn = config.attn_config, config.ffn_config
    checks = {
        "learned_pos_emb (must be true)": not config.learned_pos_emb,
        "attn_config.alibi / rope": attn.alibi or attn.rope,
        "attn_config.attn_type (must be multihead_attention)": attn.attn_type != "multihead_attention",
        "attn_config.qk_ln / qk_gn": attn.qk_ln or attn.qk_gn,
        "attn_config.clip_qkv": attn.clip_qkv is not None,
        "attn_config.softmax_scale": attn.softmax_scale is not None,
        "attn_config.sliding_window_size": attn.sliding_window_size != -1,
        "attn_config.head_dim (must be d_model / n_heads)": config.head_dim_decoupled,
        "norm_type (must be a layernorm)": "rmsnorm" in config.norm_type,
        "ffn_config.ffn_type (must be mptmlp)": ffn.ffn_type != "mptmlp",
        "ffn_config.ffn_act_fn": (ffn.ffn_act_fn.name, ffn.ffn_act_fn.approximate) not in _ACTIVATIONS,
        "logit_scale": config.logit_scale is not None,
    }
    return [feature for feature, unmappable in checks.items() if unmappable]


def to_hf_config(model: Any) -> GPT2Config:
    config = model.config
    act = config.ffn_config.ffn_act_fn
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_seq_len,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=ffn_hidden_size(config.d_model, config.expansion_ratio, config.ffn_config),
        activation_function=_ACTIVATIONS[(act.name, act.approximate)],
        resid_pdrop=float(config.resid_pdrop),
        embd_pdrop=float(config.emb_pdrop),
        attn_pdrop=float(config.attn_config.attn_pdrop),
        layer_norm_epsilon=float(config.norm_eps),
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """GPT-2's names; Conv1D weights transposed (copies: safetensors refuses shared memory); zero biases
    where the MPT has none."""
    hf_state = {_hf_name(name): _hf_tensor(name, tensor) for name, tensor in state.items()}
    if model.config.no_bias:
        for name, tensor in list(hf_state.items()):
            if name.endswith(".weight") and not name.startswith(("transformer.wte", "transformer.wpe", "lm_head")):
                out_features = tensor.shape[-1] if is_transposed(name) else tensor.shape[0]
                hf_state[name.removesuffix("weight") + "bias"] = tensor.new_zeros(out_features)
    return hf_state


def _hf_name(name: str) -> str:
    if match := _BLOCK.match(name):
        layer, module, kind = match.groups()
        if module not in _BLOCK_NAMES:
            raise ConfigError(f"GPT-2 export does not know the parameter '{name}'.")
        return f"transformer.h.{layer}.{_BLOCK_NAMES[module]}.{kind}"
    module, _, kind = name.rpartition(".")
    if module not in _TOP_NAMES:
        raise ConfigError(f"GPT-2 export does not know the parameter '{name}'.")
    return f"{_TOP_NAMES[module]}.{kind}"


def is_transposed(hf_name: str) -> bool:
    """Whether GPT-2 holds this weight as a Conv1D's (in, out): LoRA goes out with PEFT's fan_in_fan_out."""
    match = _HF_BLOCK.match(hf_name)
    return bool(match) and match.group(2) in _CONV1D and match.group(3) == "weight"


def _hf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t().contiguous() if is_transposed(_hf_name(name)) else tensor


def from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The ``model:`` section of an MPT that computes what GPT-2 config ``hf_config`` computes."""
    activation = {hf: ours for ours, hf in _ACTIVATIONS.items()}
    act_name = "gelu_pytorch_tanh" if hf_config.activation_function == "gelu_new" else hf_config.activation_function
    unsupported = {
        "activation_function": act_name not in activation,
        "scale_attn_weights": not hf_config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": hf_config.scale_attn_by_inverse_layer_idx,
        "add_cross_attention": getattr(hf_config, "add_cross_attention", False),
    }
    for key, is_set in unsupported.items():
        if is_set:
            raise ConfigError(
                f"This GPT-2 checkpoint sets '{key}' to {getattr(hf_config, key)!r}, which foundry's MPT does not "
                "compute; train it as `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}` instead."
            )
    name, approximate = activation[act_name]
    return {
        "name": FAMILY,
        "d_model": hf_config.n_embd,
        "n_heads": hf_config.n_head,
        "n_layers": hf_config.n_layer,
        "max_seq_len": hf_config.n_positions,
        "vocab_size": hf_config.vocab_size,
        "resid_pdrop": hf_config.resid_pdrop,
        "emb_pdrop": hf_config.embd_pdrop,
        "learned_pos_emb": True,
        "no_bias": False,
        "norm_type": "layernorm",
        "norm_eps": hf_config.layer_norm_epsilon,
        "attn_config": {"attn_pdrop": hf_config.attn_pdrop},
        "ffn_config": {
            "ffn_type": "mptmlp",
            "ffn_act_fn": {"name": name, "approximate": approximate},
            "ffn_hidden_size": hf_config.n_inner or 4 * hf_config.n_embd,
        },
        "tie_word_embeddings": bool(hf_config.tie_word_embeddings),
    }


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    ours = {hf: foundry for foundry, hf in _BLOCK_NAMES.items()}
    top = {hf: foundry for foundry, hf in _TOP_NAMES.items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if _HF_MASK_BUFFER.match(name):
            continue
        if match := _HF_BLOCK.match(name):
            layer, module, kind = match.groups()
            if module not in ours:
                raise ConfigError(f"GPT-2 import does not know the parameter '{name}'.")
            state[f"transformer.blocks.{layer}.{ours[module]}.{kind}"] = tensor.t() if is_transposed(name) else tensor
        else:
            module, _, kind = name.rpartition(".")
            if module == "lm_head" and hf_config.tie_word_embeddings:
                continue
            if module not in top:
                raise ConfigError(f"GPT-2 import does not know the parameter '{name}'.")
            state[f"{top[module]}.{kind}"] = tensor
    return state
