"""A model out of a foundry checkpoint, and a weights-only checkpoint out of a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from foundry.builders import build_model
from foundry.checkpoint import load_checkpoint, resolve_checkpoint_path, save_checkpoint
from foundry.checkpoint.checkpointer import META_FILE
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import CheckpointError


def checkpoint_config(path: Path) -> dict[str, Any]:
    """The resolved train config a checkpoint was saved with (``meta.json``'s ``config``)."""
    try:
        config = json.loads((path / META_FILE).read_text()).get("config") or {}
    except ValueError as error:
        raise CheckpointError(f"{path / META_FILE} is not valid JSON ({error}); use another checkpoint.") from None
    if not isinstance(config.get("model"), dict) or "name" not in config["model"]:
        raise CheckpointError(
            f"Checkpoint {path} holds no model config (its run passed no `config` to the Trainer), so foundry "
            "cannot tell which architecture the weights belong to. Save checkpoints with `foundry train`."
        )
    return config


def empty_model(model_section: dict[str, Any]) -> nn.Module:
    """The model of ``model_section`` with uninitialised CPU weights (no time spent on a random init)."""
    model = build_model({**model_section, "init_device": "meta"})
    return model.to_empty(device="cpu")


def load_model_from_checkpoint(path: str | Path) -> tuple[nn.Module, dict[str, Any], Path]:
    """(model with the checkpoint's weights on CPU, the run's config, the checkpoint folder).

    ``path`` is a checkpoint folder or a save_folder (its latest checkpoint).
    """
    folder = resolve_checkpoint_path(path)
    config = checkpoint_config(folder)
    model = empty_model(config["model"])
    load_checkpoint(folder, State(model=model, max_duration=Time.parse("1ba")), weights_only=True)
    return model, config, folder


def save_weights_checkpoint(model: nn.Module, save_folder: str | Path, config: dict[str, Any], overwrite: bool) -> Path:
    """A checkpoint at batch 0 holding only ``model``'s weights; ``load_path`` + ``load_weights_only`` read it."""
    state = State(model=model, max_duration=Time.parse("1ba"))
    return save_checkpoint(save_folder, state, config=config, overwrite=overwrite)
