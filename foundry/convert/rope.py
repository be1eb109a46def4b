"""RoPE scaling between foundry and a Hugging Face config, both ways, read the same from transformers 4.x and 5.x."""

from __future__ import annotations

from typing import Any

from foundry.errors import ConfigError
from foundry.models.attention import RopeHFConfig

# rope_type -> the keys of its ``rope_scaling`` entry; foundry's ``model.rope_scaling`` spells them the same
_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def hf_rope_scaling(scaling: RopeHFConfig) -> dict[str, float | int | str] | None:
    """``attn_config.rope_hf_config`` as a Hugging Face ``rope_scaling`` entry; ``hf_rope_settings`` reads it back.

    Floats are written as floats (a YAML ``8`` is an int; transformers 5 checks the types).
    """
    if scaling.type == "no_scaling":
        return None
    entry: dict[str, float | int | str] = {"rope_type": scaling.type}
    for key in _SCALING_KEYS[scaling.type]:
        value = getattr(scaling, key)
        entry[key] = value if key == "original_max_position_embeddings" else float(value)
    return entry


def hf_rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, foundry's ``rope_scaling`` section or None).

    transformers 5 keeps both in ``rope_parameters``; 4.x has ``rope_theta`` and ``rope_scaling``.
    """
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    scaling = dict(getattr(hf_config, "rope_scaling", None) or parameters)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if theta is None:
        raise ConfigError(f"{type(hf_config).__name__} has no rope_theta; foundry cannot read its RoPE.")
    if rope_type == "default":
        return float(theta), None
    if rope_type not in _SCALING_KEYS:
        raise ConfigError(
            f"This checkpoint uses RoPE scaling '{rope_type}'; foundry implements 'llama3' and 'linear'. Train it as "
            "`model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}` instead."
        )
    section = {"rope_type": rope_type, **{key: scaling[key] for key in _SCALING_KEYS[rope_type] if key in scaling}}
    return float(theta), section
