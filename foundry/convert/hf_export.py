"""A foundry model as a Hugging Face folder, and such a folder back as the same foundry model.

``export_hf_model`` picks the class (``foundry.convert.choose_export``: a built-in transformers class
where one computes the model exactly, else foundry's own modeling code), builds it on the meta device
around the model's tensors, and records the model's own section in ``config.json`` (``foundry_model``).
``exported_section`` reads that record back, so ``foundry convert from-hf`` rebuilds the very model
that was exported (its family, keys and weights), not merely an equivalent one; a record that no
longer describes the folder's network (an edited config) is ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from foundry.convert import ExportChoice, choose_export, family_of_model_type, import_adapter
from foundry.convert.checkpoint_io import assign_weights, meta_model
from foundry.errors import ConfigError
from foundry.models.hf import HFCausalLM

SECTION_KEY = "foundry_model"  # config.json: the model section the folder was exported from


@dataclasses.dataclass
class HFExport:
    hf_model: nn.Module
    description: str  # the class, and why it was chosen


def export_hf_model(
    model: nn.Module,
    model_name: str,
    state_dict: dict[str, torch.Tensor] | None = None,
    section: dict[str, Any] | None = None,
) -> HFExport:
    """The ``transformers`` model computing ``model`` with its weights (or ``state_dict``'s, same keys).

    Tensors are shared where names map one to one. ``section`` (default: ``model.model_section()``) is the
    model section recorded in config.json. An ``hf_causal_lm`` is its own transformers model (``state_dict``
    and ``section`` do not apply).
    """
    if isinstance(model, HFCausalLM):
        return HFExport(model.hf_model, f"{type(model.hf_model).__name__} (the hf_causal_lm model itself)")
    choice = choose_export(model, model_name)
    return HFExport(_build(model, choice, state_dict, section), choice.describe())


def to_hf_model(model: nn.Module, model_name: str, state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """``export_hf_model(...).hf_model``."""
    return export_hf_model(model, model_name, state_dict).hf_model


def _build(
    model: nn.Module,
    choice: ExportChoice,
    state_dict: dict[str, torch.Tensor] | None,
    section: dict[str, Any] | None,
) -> nn.Module:
    adapter = choice.adapter
    hf_config = adapter.to_hf_config(model)
    if section is None and hasattr(model, "model_section"):
        section = model.model_section()
    if section is not None:
        setattr(hf_config, SECTION_KEY, section)
    hf_state = adapter.to_hf_state_dict(model.state_dict() if state_dict is None else state_dict, model)
    with torch.device("meta"):  # no random init of weights about to be replaced (an 8B model is 32 GB)
        if hasattr(adapter, "build_hf_model"):
            hf_model = adapter.build_hf_model(hf_config)
        else:
            hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return assign_weights(hf_model, hf_state, f"{model_name_of(model)} to {type(hf_model).__name__}").eval()


def model_name_of(model: nn.Module) -> str:
    section = model.model_section() if hasattr(model, "model_section") else None
    return section["name"] if section else type(model).__name__


def save_hf_folder(hf_model: nn.Module, out_dir: Path, tokenizer: Any = None) -> None:
    """Weights (safetensors), config, the modeling code where the class is foundry's, and the tokenizer."""
    hf_model.save_pretrained(out_dir)
    family = family_of_model_type(getattr(hf_model.config, "model_type", ""))
    if family is not None and not family.built_in:
        import_adapter(family).write_code(Path(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def exported_section(
    raw_config: dict[str, Any], adapter: ModuleType, imported: dict[str, Any]
) -> dict[str, Any] | None:
    """The model section foundry recorded when it exported this folder, if it still describes the folder's
    network: the recorded model, exported again, imports as the folder does (``imported``)."""
    recorded = raw_config.get(SECTION_KEY)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str):
        return None
    try:
        model = meta_model(recorded)
        choice = choose_export(model, recorded["name"])
        if choice.adapter is not adapter:
            return None
        again = adapter.from_hf_config(adapter.to_hf_config(model))
    except ConfigError:
        return None
    return dict(recorded) if again == imported else None


def fit_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` without the tensors ``model`` lacks, each of which must be all zeros (a bias a class without
    bias-free layers holds for a model that has none)."""
    names = set(model.state_dict())
    extra = [name for name in state if name not in names]
    nonzero = [name for name in extra if bool(state[name].any())]
    if nonzero:
        raise ConfigError(
            f"The folder's weights {nonzero[:3]} are not zero but the recorded model has no such parameters; its "
            "weights were changed after export. Remove 'foundry_model' from config.json to import it as it is."
        )
    return {name: tensor for name, tensor in state.items() if name in names}
