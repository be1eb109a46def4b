"""Moving weights between foundry and Hugging Face transformers.

One adapter module per architecture (``llama``: ``LlamaForCausalLM``, ``mpt``: ``MptForCausalLM``)
with the same four functions: ``to_hf_config(model)``, ``to_hf_state_dict(state, model)``,
``from_hf_config(hf_config) -> model section``, ``from_hf_state_dict(state, hf_config)``; round trips are exact.
``commands`` holds ``foundry convert to-hf`` and ``foundry convert from-hf``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from foundry.errors import ConfigError

# foundry model name -> (adapter module, Hugging Face model_type)
_FAMILIES = {"llama_causal_lm": ("foundry.convert.llama", "llama"), "mpt_causal_lm": ("foundry.convert.mpt", "mpt")}


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
    for module_name, hf_type in _FAMILIES.values():
        if hf_type == model_type:
            return _import(module_name)
    supported = ", ".join(sorted(hf_type for _, hf_type in _FAMILIES.values()))
    raise ConfigError(
        f"foundry convert from-hf reads model_type {supported}, not '{model_type}'. Any causal LM trains "
        "without conversion through `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}`."
    )


def _import(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)
