"""Moving weights between foundry and Hugging Face transformers.

One adapter module per architecture (``llama``: ``LlamaForCausalLM``, ``mpt``: ``MptForCausalLM``;
mixtures of experts: ``mixtral``, ``olmoe``, ``qwen3_moe``, ``dbrx``) with the same four functions:
``to_hf_config(model)``, ``to_hf_state_dict(state, model)``, ``from_hf_config(hf_config) -> model section``,
``from_hf_state_dict(state, hf_config)``; round trips are exact. The MoE adapters also tell which models
they compute (``unmappable_features(config)``).
``commands`` holds ``foundry convert to-hf`` and ``foundry convert from-hf``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from foundry.errors import ConfigError
from foundry.models.hf import NATIVE_MOE

# foundry model name -> (adapter module, Hugging Face model_type)
_FAMILIES = {"llama_causal_lm": ("foundry.convert.llama", "llama"), "mpt_causal_lm": ("foundry.convert.mpt", "mpt")}
# Mixture-of-experts classes: (adapter module, model_type, the foundry model it exports). Export takes the
# first whose ``unmappable_features(model.config)`` is empty; a model with experts has no other class.
_MOE_FAMILIES = tuple((f"foundry.convert.{model_type}", model_type, name) for model_type, name in NATIVE_MOE.items())


def adapter_for_model(model: Any, model_name: str) -> ModuleType:
    """The adapter that exports ``model`` (``model.name: <model_name>``): an MoE class for a model with experts."""
    ffn_config = getattr(getattr(model, "config", None), "ffn_config", None)
    if not getattr(ffn_config, "is_moe", False):
        return adapter_for_family(model_name)
    reasons = {}
    for module_name, _, exported in _MOE_FAMILIES:
        if exported == model_name:
            adapter = _import(module_name)
            reasons[module_name.rsplit(".", 1)[1]] = adapter.unmappable_features(model.config)
            if not reasons[module_name.rsplit(".", 1)[1]]:
                return adapter
    detail = "; ".join(f"{name} lacks model.{', model.'.join(features)}" for name, features in reasons.items())
    raise ConfigError(
        f"No Hugging Face class computes this mixture of experts ({detail or model_name}); it cannot be exported."
    )


def adapter_for_family(model_name: str) -> ModuleType:
    """The adapter that exports ``model.name: <model_name>``."""
    if model_name not in _FAMILIES:
        raise ConfigError(
            f"foundry cannot export model.name '{model_name}' to Hugging Face; exportable families: "
            f"{', '.join(sorted(_FAMILIES))}. An hf_causal_lm model is already a transformers model: its "
            "hf_model.save_pretrained() writes it."
        )
    return _import(_FAMILIES[model_name][0])


def adapter_for_hf(model_type: str) -> ModuleType:
    """The adapter that imports a Hugging Face checkpoint of ``config.model_type``."""
    for module_name, hf_type in [*_FAMILIES.values(), *((module, hf_type) for module, hf_type, _ in _MOE_FAMILIES)]:
        if hf_type == model_type:
            return _import(module_name)
    supported = ", ".join(sorted([*(hf_type for _, hf_type in _FAMILIES.values()), *(t for _, t, _ in _MOE_FAMILIES)]))
    raise ConfigError(
        f"foundry convert from-hf reads model_type {supported}, not '{model_type}'. Any causal LM trains "
        "without conversion through `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}`."
    )


def _import(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)
