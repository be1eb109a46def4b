"""LLM Foundry's own MPT (``llmfoundry.models.mpt``) as foundry's ``mpt_causal_lm``: the same architecture.

LLM Foundry writes its MPT two ways: inside a Composer checkpoint (``foundry.convert.composer``) and as
a Hugging Face folder whose config.json has ``model_type: mpt`` and an ``auto_map`` naming its own
modeling code (``modeling_mpt.MPTForCausalLM``), as its ``hf_checkpointer`` callback and
``convert_composer_to_hf.py`` write it. transformers' built-in ``MptForCausalLM`` shares the
model_type but not the architecture (no learned positions, no biases), so such a folder loaded
through it computes something else. foundry's MPT has LLM Foundry's config keys and parameter names:
the folder loads as ``mpt_causal_lm`` here, its own code never runs.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry.checkpoint.hf_weights import layers_of_folder
from foundry.convert.checkpoint_io import assign_weights, meta_model, stream_into
from foundry.data import load_tokenizer
from foundry.errors import CheckpointError
from foundry.models.mpt import MPTConfig

_LLM_FOUNDRY_MPT_CLASS = "MPTForCausalLM"  # LLM Foundry's spelling; transformers' is MptForCausalLM
# Keys of LLM Foundry's MPT config that describe no computation (Hugging Face bookkeeping, derived values);
# so are transformers' private keys ("_attn_implementation_autoset", written by 4.51, LLM Foundry 0.22's pin).
_HF_BOOKKEEPING = {"model_type", "transformers_version", "architectures", "torch_dtype", "dtype", "attention_bias",
                   "head_dim", "auto_map", "use_cache", "init_device"}  # fmt: skip
# LLM Foundry MPT keys foundry's lacks (where they sit), with the value at which foundry computes the same.
_OFF_IN_LLM_FOUNDRY: dict[str, Any] = {
    "fc_type": {"name": "torch"},  # under ffn_config: plain nn.Linear layers
    "block_overrides": None,
    "final_logit_softcapping": None,
    "nope": False,
    "attn_temperature_tuning": {"attn_scale": 0.0, "floor_scale": 8192},
}


def is_llm_foundry_mpt_export(config: dict[str, Any]) -> bool:
    """A config.json LLM Foundry wrote for its MPT: model_type mpt, and its own class in ``auto_map``."""
    auto_map = config.get("auto_map") or {}
    causal_lm = str(auto_map.get("AutoModelForCausalLM", ""))
    return config.get("model_type") == "mpt" and causal_lm.rpartition(".")[2] == _LLM_FOUNDRY_MPT_CLASS


def mpt_section(source: Path, config: dict[str, Any]) -> dict[str, Any]:
    """foundry's ``model:`` section for LLM Foundry MPT config ``config`` (read from ``source``).

    A feature foundry's MPT lacks is dropped when it is off and refused, naming it, when it is on.
    """
    keys = {key: value for key, value in config.items() if key not in _HF_BOOKKEEPING}
    return {"name": "mpt_causal_lm", **_foundry_keys(source, MPTConfig, keys, "")}


def _foundry_keys(source: Path, config_class: type, keys: dict[str, Any], key_path: str) -> dict[str, Any]:
    """``keys`` that foundry's ``config_class`` has (nested sections too); transformers' private keys (``_...``)
    are dropped, a feature foundry lacks is dropped when off (``_OFF_IN_LLM_FOUNDRY``) and refused when on."""
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    hints = typing.get_type_hints(config_class)
    kept = {}
    for key, value in keys.items():
        if key.startswith("_"):
            continue
        if key not in fields:
            if _OFF_IN_LLM_FOUNDRY.get(key, object()) != value:
                raise CheckpointError(
                    f"{source}: its model sets '{key_path}{key}' to {value!r}, a feature of LLM Foundry's MPT that "
                    "foundry's mpt_causal_lm does not implement, so its weights would not compute the same here."
                )
            continue
        nested = hints[key]
        if isinstance(value, dict) and dataclasses.is_dataclass(nested):
            value = _foundry_keys(source, nested, value, f"{key_path}{key}.")
        kept[key] = value
    return kept


def load_llm_foundry_export(folder: Path) -> tuple[nn.Module, dict[str, Any]]:
    """(foundry's MPT holding the weights of LLM Foundry's HF folder ``folder`` in fp32, its model section)."""
    config = json.loads((folder / "config.json").read_text())
    section = mpt_section(folder / "config.json", config)
    model, source = meta_model(section), f"{folder} to mpt_causal_lm"
    stream_into(model, layers_of_folder(folder), _without_output_head, source)
    return assign_weights(model, {}, source).eval(), section


def _without_output_head(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LLM Foundry's export writes the tied output head beside the embedding it shares."""
    return {name: tensor for name, tensor in layer.items() if name != "lm_head.weight"}


def load_export_tokenizer(folder: Path) -> Any:
    """The tokenizer LLM Foundry wrote beside its export.

    transformers 5 builds the folder's config while it looks for the tokenizer class, and its strict
    ``MptConfig`` refuses LLM Foundry's MPT config (``attn_pdrop: 0.0`` where it wants an int), so the
    tokenizer is read with a blank config instead.
    """
    from transformers import PretrainedConfig

    return load_tokenizer(str(folder), config=PretrainedConfig())
