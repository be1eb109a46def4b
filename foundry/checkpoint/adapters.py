"""LoRA checkpoints: what an adapters-only save keeps, and which checkpoint holds the base under an adapter.

A checkpoint of a LoRA run holds every weight, unless ``model.peft_config.save_adapters_only`` is
set: then its model part is the adapter tensors alone (its optimizer state is adapters-only anyway).
Such a checkpoint names its base through its run's ``load_path``: ``foundry.checkpoint.load`` loads
that base first.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from foundry.checkpoint.find import resolve_checkpoint_path
from foundry.checkpoint.layout import META_FILE, read_json_object
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from foundry.errors import CheckpointError
from foundry.models.lora import LoraConfig, is_adapter_key

if TYPE_CHECKING:
    from torch import nn


def model_lora_config(model: nn.Module) -> LoraConfig | None:
    """The ``peft_config`` a model was built with (None: no LoRA)."""
    config = getattr(getattr(model, "config", None), "peft_config", None)
    return config if isinstance(config, LoraConfig) else None


def model_state_to_save(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` as a checkpoint stores it: only the adapters when the model says so."""
    config = model_lora_config(model)
    if config is None or not config.save_adapters_only:
        return model_state
    return {name: tensor for name, tensor in model_state.items() if is_adapter_key(name)}


def loadable_without(missing: Collection[str], saved: Collection[str]) -> bool:
    """Whether a checkpoint lacking the model keys ``missing`` still loads (those keep their values).

    Two cases: a base checkpoint into a LoRA model (only adapters missing: they keep their init), and
    an adapters-only checkpoint (only base weights missing: its base was loaded first).
    """
    if not missing:
        return True
    return all(is_adapter_key(key) for key in missing) or (bool(saved) and all(map(is_adapter_key, saved)))


def saved_model_keys(folder: Path) -> set[str]:
    """The model keys a checkpoint holds (read from its DCP metadata, no tensor is read)."""
    keys = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}


def holds_adapters_only(folder: Path) -> bool:
    keys = saved_model_keys(folder)
    return bool(keys) and all(map(is_adapter_key, keys))


def has_pretrained_base(model_section: Mapping[str, Any]) -> bool:
    """Whether a model section loads its base weights itself: ``hf_causal_lm`` with ``pretrained`` (the default)."""
    return model_section.get("name") == "hf_causal_lm" and model_section.get("pretrained", True) is not False


def base_checkpoint(folder: Path) -> Path | None:
    """The checkpoint that holds the base weights of adapters-only checkpoint ``folder`` (its run's load_path).

    None: the run had no load_path and its model is a pretrained ``hf_causal_lm``, whose base is its
    ``pretrained_model_name_or_path``.
    """
    config = read_json_object(folder / META_FILE).get("config") or {}
    load_path = config.get("load_path")
    if not load_path and has_pretrained_base(config.get("model") or {}):
        return None
    if not load_path:
        raise CheckpointError(
            f"Checkpoint {folder} holds LoRA adapters only (model.peft_config.save_adapters_only) and its run had no "
            "load_path, so the base weights it was trained on are unknown. Name the base yourself: "
            f"`foundry eval --model BASE --adapters {folder}`, or load a checkpoint saved with "
            "save_adapters_only: false."
        )
    try:
        return resolve_checkpoint_path(load_path)
    except CheckpointError as error:
        raise CheckpointError(
            f"Checkpoint {folder} holds LoRA adapters only; its base is its run's load_path '{load_path}', which "
            f"cannot be read ({error}). Restore the base there, or name it yourself: "
            f"`foundry eval --model BASE --adapters {folder}`."
        ) from None


def read_adapter_tensors(folder: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of checkpoint ``folder``, shaped as ``like`` (a model's ``adapter_state_dict``)."""
    saved = saved_model_keys(folder)
    missing = sorted(set(like) - saved)
    if missing:
        raise CheckpointError(
            f"Checkpoint {folder} lacks the adapter tensors {missing[:3]}{'...' if len(missing) > 3 else ''}: it was "
            "not trained with the same model.peft_config (r, target_modules) as this model."
        )
    wanted = {"model": {name: torch.empty_like(tensor, device="cpu") for name, tensor in like.items()}}
    dcp.load(wanted, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(allow_partial_load=True))
    return wanted["model"]
