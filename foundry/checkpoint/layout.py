"""What a checkpoint folder holds, how its contents are keyed, and how to find the newest complete one.

A checkpoint is a folder ``<save_folder>/ep{epoch}-ba{batch}/``::

    .metadata, __*.distcp   model and optimizer tensors (torch.distributed.checkpoint, any sharding)
    meta.json               timestamp, schedulers, callbacks, algorithms, dataloader, config, run info
    rng-rank{r}.json        each rank's random generators

It is written into ``.tmp-<name>-<random>/`` and renamed into place only when complete, so a run
killed mid-save leaves just a ``.tmp-*`` folder: readers ignore it and the next save deletes it.
``<save_folder>/latest`` names the newest checkpoint. Writing is ``foundry.checkpoint.save``, reading
``foundry.checkpoint.load``.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from foundry.checkpoint.safe_reader import METADATA_FILE
from foundry.core.state import State
from foundry.core.time import Timestamp
from foundry.errors import CheckpointError

FORMAT_VERSION = 1
META_FILE = "meta.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
_CHECKPOINT_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")


def checkpoint_name(timestamp: Timestamp) -> str:
    return f"ep{timestamp.epoch}-ba{timestamp.batch}"


def tensor_state(state: State, model_only: bool = False) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (``get_state_dict`` also handles FSDP2)."""
    if model_only or not state.optimizers:
        return {"model": get_model_state_dict(state.model)}
    model_state, optim_state = get_state_dict(state.model, state.optimizers)
    return {"model": model_state, "optim": optim_state}


def stateful_key_pairs(objects: Sequence) -> Iterator[tuple[str, Any]]:
    """Key objects by class name ("Foo", "Foo.1", ...) so adding another callback does not shift the rest."""
    seen: dict[str, int] = {}
    for obj in objects:
        class_name = type(obj).__name__
        count = seen.get(class_name, 0)
        seen[class_name] = count + 1
        yield (class_name if count == 0 else f"{class_name}.{count}"), obj


# ---------------------------------------------------------------------------------------- find
def latest_checkpoint(save_folder: str | Path) -> Path | None:
    """The newest complete checkpoint in ``save_folder`` (as ``latest`` names it), or None."""
    save_folder = Path(save_folder)
    if not save_folder.is_dir():
        return None
    pointer = save_folder / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        candidate = save_folder / name
        if name and Path(name).name == name and not name.startswith(".") and _is_complete(candidate):
            return candidate
    complete = complete_checkpoints(save_folder)
    return complete[-1] if complete else None


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder as given, or a save_folder's latest checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"No checkpoint at {path}: nothing exists there. Check load_path: give a checkpoint folder "
            "(e.g. <save_folder>/ep0-ba100) or a save_folder to load its latest checkpoint."
        )
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder (e.g. <save_folder>/ep0-ba100).")
    is_checkpoint = _CHECKPOINT_NAME.match(path.name) or (path / META_FILE).exists() or (path / METADATA_FILE).exists()
    if is_checkpoint:
        _check_complete(path)
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path} holds no complete checkpoint (no ep*-ba* folder with {META_FILE} and {METADATA_FILE}). "
            "Point load_path at a checkpoint folder or at the save_folder of a run that saved one."
        )
    return latest


def complete_checkpoints(save_folder: Path) -> list[Path]:
    """Complete ``ep*-ba*`` checkpoints in ``save_folder``, oldest first."""
    found = []
    for path in save_folder.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match and _is_complete(path):
            found.append(((int(match.group(2)), int(match.group(1))), path))
    return [path for _, path in sorted(found)]


def _is_complete(folder: Path) -> bool:
    return (folder / META_FILE).is_file() and (folder / METADATA_FILE).is_file()


def _check_complete(folder: Path) -> None:
    for file_name in (META_FILE, METADATA_FILE):
        if not (folder / file_name).is_file():
            raise CheckpointError(
                f"Checkpoint {folder} has no {file_name}: the checkpoint is incomplete (its save was "
                "interrupted or files were removed). Load an earlier checkpoint from the same folder."
            )


# -------------------------------------------------------- shared by save, load and consolidate
def root_cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (a BaseException), else ``exc``."""
    for failure, _traceback in getattr(exc, "failures", {}).values():
        return failure
    return exc


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes one process: that is our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def fsync_dir(folder: Path) -> None:
    # A rename survives power loss only once its folder is synced too; not every OS allows this.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
