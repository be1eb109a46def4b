"""Moving weights between foundry and Hugging Face transformers.

One adapter module per Hugging Face class, all with the same functions: ``unmappable_features(config)``
(the settings of a foundry model config the class cannot compute exactly; empty when it can; an adapter
without it computes every config of the families it exports),
``to_hf_config(model)``, ``to_hf_state_dict(state, model)``, ``from_hf_config(hf_config) -> model
section`` and ``from_hf_state_dict(state, hf_config)``; round trips are exact. ``HF_FAMILIES`` (in
``foundry.models.hf_families``, which the loaders read too) is the table that joins them: which foundry
models each exports, in order of preference, and which ``model_type`` each imports. A new family is one
more row. ``commands`` holds ``foundry convert to-hf``
and ``from-hf``.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

from foundry.errors import ConfigError
from foundry.models.hf_families import HF_FAMILIES, HFFamily


@dataclasses.dataclass(frozen=True)
class ExportChoice:
    family: HFFamily
    adapter: ModuleType
    passed_over: dict[str, list[str]]  # earlier classes -> the settings each cannot compute

    def describe(self) -> str:
        """One line for the user: which class, and why not a built-in one."""
        how = "built into transformers" if self.family.built_in else "foundry's modeling code, trust_remote_code=True"
        reasons = "; ".join(f"{name} lacks {', '.join(features)}" for name, features in self.passed_over.items())
        return f"{self.family.hf_class} ({how}){f': {reasons}' if reasons and not self.family.built_in else ''}"


def choose_export(model: Any, model_name: str) -> ExportChoice:
    """The first class of ``HF_FAMILIES`` that computes ``model`` (``model.name: <model_name>``) exactly."""
    passed_over: dict[str, list[str]] = {}
    for family in HF_FAMILIES:
        if model_name not in family.exports:
            continue
        adapter = import_adapter(family)
        unmappable = adapter.unmappable_features(model.config) if hasattr(adapter, "unmappable_features") else []
        if not unmappable:
            return ExportChoice(family, adapter, passed_over)
        passed_over[family.hf_class] = unmappable
    exportable = sorted({name for family in HF_FAMILIES for name in family.exports})
    if not passed_over:
        raise ConfigError(
            f"foundry cannot export model.name '{model_name}' to Hugging Face; exportable families: "
            f"{', '.join(exportable)}. An hf_causal_lm model is already a transformers model: its "
            "hf_model.save_pretrained() writes it."
        )
    reasons = "; ".join(f"{name} lacks model.{', model.'.join(features)}" for name, features in passed_over.items())
    raise ConfigError(f"No Hugging Face class computes this {model_name} ({reasons}); it cannot be exported.")


def family_of_model_type(model_type: str) -> HFFamily | None:
    return next((family for family in HF_FAMILIES if family.model_type == model_type), None)


def import_adapter(family: HFFamily) -> ModuleType:
    return importlib.import_module(family.module)


def adapter_for_hf(model_type: str) -> ModuleType:
    """The adapter that imports a Hugging Face checkpoint of ``config.model_type``."""
    family = family_of_model_type(model_type)
    if family is not None:
        return import_adapter(family)
    supported = ", ".join(sorted(family.model_type for family in HF_FAMILIES))
    raise ConfigError(
        f"foundry convert from-hf reads model_type {supported}, not '{model_type}'. Any causal LM trains "
        "without conversion through `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>}`."
    )
