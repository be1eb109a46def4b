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

from foundry.checkpoint.layout import FORMAT_VERSION, META_FILE, parse_json_object, read_json_object
from foundry.errors import CheckpointError


def read_meta(folder: Path) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint ``folder`` as a mapping; a ``CheckpointError`` naming it if unreadable."""
    return _checked_version(read_json_object(Path(folder) / META_FILE), str(folder))


def parse_meta(data: bytes, where: str) -> dict[str, Any]:
    """A ``meta.json`` read as bytes (from an object store), checked as ``read_meta`` checks a local one."""
    return _checked_version(parse_json_object(data, where), where)


def format_version(folder: Path) -> int | None:
    """meta.json's ``format_version`` (1 when absent), or None when meta.json cannot be read."""
    try:
        version = read_json_object(Path(folder) / META_FILE).get("format_version", 1)
    except CheckpointError:
        return None
    return version if isinstance(version, int) else None


def run_name_of(meta: Mapping[str, Any]) -> str | None:
    """The name of the run that saved the checkpoint (``run.run_name``), or None if it recorded none."""
    run = meta.get("run")
    name = run.get("run_name") if isinstance(run, Mapping) else None
    return name if isinstance(name, str) else None


def _checked_version(meta: dict[str, Any], where: str) -> dict[str, Any]:
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {where} has format version {version!r}, newer than this foundry reads ({FORMAT_VERSION}). "
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


def dotted_leaves(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"attn_config": {"alibi": True}}`` as ``{"attn_config.alibi": True}``, to compare two sections key by key.

    Tuples become lists, as meta.json stores them, so a section read back compares equal to the one written.
    """
    leaves: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, Mapping):
            leaves.update(dotted_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return leaves


def tokenizer_section_of(tokenizer: Any) -> dict[str, Any] | None:
    """``{"name": ..., "kwargs": {}}`` that reloads ``tokenizer`` (a local folder as an absolute path), or None."""
    name = getattr(tokenizer, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    if Path(name).is_dir():
        name = str(Path(name).resolve())
    return {"name": name, "kwargs": {}}
