"""A model out of a foundry checkpoint, and a weights-only checkpoint out of a model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from foundry.builders import build_model
from foundry.checkpoint import load_checkpoint, resolve_checkpoint_path, save_checkpoint
from foundry.checkpoint.layout import META_FILE
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import CheckpointError


def checkpoint_config(folder: Path) -> dict[str, Any]:
    """The resolved train config a checkpoint was saved with (``meta.json``'s ``config``)."""
    try:
        config = json.loads((folder / META_FILE).read_text()).get("config") or {}
    except ValueError as error:
        raise CheckpointError(f"{folder / META_FILE} is not valid JSON ({error}); use another checkpoint.") from None
    if not isinstance(config.get("model"), dict) or "name" not in config["model"]:
        raise CheckpointError(
            f"Checkpoint {folder} holds no model config (its run passed no `config` to the Trainer), so foundry "
            "cannot tell which architecture the weights belong to. Save checkpoints with `foundry train`."
        )
    return config


def meta_model(model_section: Mapping[str, Any]) -> nn.Module:
    """The model of ``model_section`` with every weight on the meta device: no memory, no random init."""
    return build_model({**model_section, "init_device": "meta"})


def load_checkpoint_model(folder: Path, model_section: Mapping[str, Any]) -> nn.Module:
    """``model_section``'s model on CPU holding the weights of checkpoint ``folder`` (nothing else is read)."""
    model = meta_model(model_section).to_empty(device="cpu")
    load_checkpoint(folder, State(model=model, max_duration=Time.parse("1ba")), weights_only=True)
    return model


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(checkpoint folder, its run's config); ``path`` is a checkpoint folder or a save_folder (its latest)."""
    folder = resolve_checkpoint_path(path)
    return folder, checkpoint_config(folder)


def save_weights_checkpoint(model: nn.Module, save_folder: Path, config: dict[str, Any], overwrite: bool) -> Path:
    """A checkpoint at batch 0 holding only ``model``'s weights; ``load_path`` + ``load_weights_only`` read it."""
    state = State(model=model, max_duration=Time.parse("1ba"))
    return save_checkpoint(save_folder, state, config=config, overwrite=overwrite)
