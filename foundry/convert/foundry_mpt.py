"""foundry's MPT <-> its own modeling code, written into the export: every MPT setting, exactly.

When no built-in transformers class computes an MPT exactly (grouped-query attention, QK norm, GLU
with biases, RMSNorm with ALiBi, untied heads, a logit scale, ...), the export carries
``remote_code/modeling_foundry_mpt.py`` (torch and transformers only) and names it in ``auto_map``;
``config.json`` holds foundry's own model section (model_type ``foundry_mpt``). Parameter names are
foundry's, so weights map one to one. transformers has no built-in class of that model_type, so the
folder never loads silently as something else: it needs ``trust_remote_code=True``. foundry reads such
a folder back without running its code.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch

from foundry.convert.remote_code import modeling_foundry_mpt as code
from foundry.models.mpt import MPTConfig

FAMILY = "mpt_causal_lm"
CODE_FILE = Path(code.__file__)
AUTO_MAP = {
    "AutoConfig": f"{CODE_FILE.stem}.{code.FoundryMPTConfig.__name__}",
    "AutoModelForCausalLM": f"{CODE_FILE.stem}.{code.FoundryMPTForCausalLM.__name__}",
}
_COMPUTED_FFN_TYPES = ("mptmlp", "mptglu")
# Keys of the model section that say how to train, not what the network computes.
_TRAINING_KEYS = {"name", "init_config", "param_init_fn", "init_device", "use_cache", "loss_fn", "attn_impl",
                  "fc_type", "use_pad_tok_in_ffn", "peft_config", "activation_checkpointing_target"}  # fmt: skip


def unmappable_features(config: Any) -> list[str]:
    """What the modeling code does not compute: feed-forward types beyond the dense ones, heads of their own width."""
    ffn_type = config.ffn_config.ffn_type
    unmappable = [f"ffn_config.ffn_type {ffn_type}"] if ffn_type not in _COMPUTED_FFN_TYPES else []
    return unmappable + (["attn_config.head_dim (must be d_model / n_heads)"] if config.head_dim_decoupled else [])


def is_foundry_export(config: dict[str, Any]) -> bool:
    """A config.json foundry wrote with its own modeling code."""
    return config.get("model_type") == code.FoundryMPTConfig.model_type and bool(config.get("auto_map"))


def to_hf_config(model: Any) -> code.FoundryMPTConfig:
    section = {key: value for key, value in model.model_section().items() if key not in _TRAINING_KEYS}
    section["attn_config"] = {**section["attn_config"], "attn_impl": "sdpa"}
    hf_config = code.FoundryMPTConfig(**section, architectures=[code.FoundryMPTForCausalLM.__name__])
    hf_config.auto_map = dict(AUTO_MAP)
    return hf_config


def build_hf_model(hf_config: code.FoundryMPTConfig) -> torch.nn.Module:
    return code.FoundryMPTForCausalLM(hf_config)


def write_code(out_dir: Path) -> None:
    """The modeling file beside the weights, where ``auto_map`` points."""
    shutil.copyfile(CODE_FILE, out_dir / CODE_FILE.name)


def to_hf_state_dict(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    del model
    return dict(state)


def from_hf_config(hf_config: Any) -> dict[str, Any]:
    """The ``model:`` section stored in the export's config (foundry's own keys; ``hf_config`` may be config.json's
    dict, which leaves out values equal to transformers' defaults)."""
    if isinstance(hf_config, dict):
        hf_config = code.FoundryMPTConfig.from_dict(hf_config)
    keys = hf_config.to_dict()
    fields = {field.name for field in dataclasses.fields(MPTConfig)}
    return {"name": FAMILY, **{key: value for key, value in keys.items() if key in fields}}


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    del hf_config
    return dict(hf_state)
