"""``meta.json``: a checkpoint's training state, its run's config and the model it holds, read in one place.

Written by ``foundry.checkpoint.save``. Its keys: ``format_version``, ``name``, ``timestamp``,
``schedulers``, ``callbacks``, ``algorithms``, ``dataloader``, ``config`` (the resolved YAML of a
``foundry train`` run, else null), ``model`` (the registered model's name and its own config, taken
from the model object, so any Trainer's checkpoint reopens), ``tokenizer`` and ``run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foundry.checkpoint.layout import FORMAT_VERSION, META_FILE, read_json_object
from foundry.errors import CheckpointError


def read_meta(folder: Path) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint ``folder`` as a mapping; a ``CheckpointError`` naming it if unreadable."""
    meta = read_json_object(Path(folder) / META_FILE)
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {folder} has format version {version!r}, newer than this foundry reads ({FORMAT_VERSION}). "
            "Upgrade foundry."
        )
    return meta


def model_section(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The model a checkpoint holds, as a model section (``name`` + its keys), or None if it names none.

    The model's own record comes first; checkpoints written before it existed name their model in the
    run's config.
    """
    for section in (meta.get("model"), (meta.get("config") or {}).get("model")):
        if isinstance(section, Mapping) and isinstance(section.get("name"), str):
            return dict(section)
    return None


def tokenizer_section(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The tokenizer a checkpoint's model reads (``name`` + ``kwargs``), or None if it names none."""
    for section in ((meta.get("config") or {}).get("tokenizer"), meta.get("tokenizer")):
        if isinstance(section, Mapping) and isinstance(section.get("name"), str):
            return dict(section)
    return None


def model_section_of(model: Any) -> dict[str, Any] | None:
    """The model section that rebuilds ``model`` (its ``model_section()``), or None for a model that has none."""
    section = getattr(model, "model_section", None)
    return section() if callable(section) else None


def tokenizer_section_of(tokenizer: Any) -> dict[str, Any] | None:
    """``{"name": ..., "kwargs": {}}`` that reloads ``tokenizer`` (a local folder as an absolute path), or None."""
    name = getattr(tokenizer, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    if Path(name).is_dir():
        name = str(Path(name).resolve())
    return {"name": name, "kwargs": {}}
