"""What a checkpoint folder holds, how its contents are keyed, and how its files are written durably.

A checkpoint is a folder ``<save_folder>/ep{epoch}-ba{batch}/``::

    .metadata, __*.distcp   model and optimizer tensors (torch.distributed.checkpoint, any sharding)
    meta.json               timestamp, schedulers, callbacks, algorithms, dataloader, config, run info
    rng-rank{r}.json        each rank's random generators
    manifest.json           every other file's size and checksum, and the publish sequence (written last)

It is written into ``.tmp-<name>-<random>/`` and renamed into place only when complete, so a run
killed mid-save leaves just a ``.tmp-*`` folder: readers ignore it and the next run deletes it.
The newest checkpoint is the one published last (the highest manifest sequence), whatever its
name; ``<save_folder>/latest`` names it too, for people and scripts, but nothing relies on it, so a
kill between the rename and the pointer's update costs nothing. Every reader checks the files
against the manifest first (``foundry.checkpoint.integrity``); ``foundry.checkpoint.find`` picks the
checkpoint to load. Writing is ``foundry.checkpoint.save``, reading ``foundry.checkpoint.load``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from foundry.checkpoint.hooks import checkpoint_hooks
from foundry.core.state import State
from foundry.core.time import Timestamp
from foundry.distributed.tensor_parallel import gather_parts
from foundry.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: manifest.json with checksums
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
DAMAGED_SUFFIX = ".damaged"
CHECKPOINT_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")
_RANK_FILE = re.compile(r"^(?:rng-rank(\d+)\.json|__(\d+)_\d+\.distcp)$")  # rng.rng_file_name, DCP's data files


def checkpoint_name(timestamp: Timestamp) -> str:
    return f"ep{timestamp.epoch}-ba{timestamp.batch}"


def tensor_state(state: State, model_only: bool = False, frozen: bool = True) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name as DCP writes it: tensor-parallel parts gathered."""
    return gather_parts(native_tensor_state(state, model_only, frozen))


def native_tensor_state(
    state: State, model_only: bool = False, frozen: bool = True, as_stored: bool = False
) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (``get_state_dict`` also handles FSDP2).

    ``frozen=False`` leaves out the weights no optimizer trains. With ``as_stored`` (or ``frozen=False``), weights
    are as the model stores them (``CheckpointHooks.weights_as_stored``: 4-bit weights are not dequantized).
    """
    options = StateDictOptions(ignore_frozen_params=not frozen)
    hooks = checkpoint_hooks(state.model)
    with hooks.weights_as_stored() if as_stored or not frozen else contextlib.nullcontext():
        if model_only or not state.optimizers:
            return {"model": get_model_state_dict(state.model, options=options)}
        model_state, optim_state = get_state_dict(state.model, state.optimizers, options=options)
    return {"model": model_state, "optim": optim_state}


def stateful_key_pairs(objects: Sequence) -> Iterator[tuple[str, Any]]:
    """Key objects by class name ("Foo", "Foo.1", ...) so adding another callback does not shift the rest."""
    seen: dict[str, int] = {}
    for obj in objects:
        class_name = type(obj).__name__
        count = seen.get(class_name, 0)
        seen[class_name] = count + 1
        yield (class_name if count == 0 else f"{class_name}.{count}"), obj


# ---------------------------------------------------------------------------------------- names
def named_folders(save_folder: str | Path) -> list[Path]:
    """The ``ep*-ba*`` folders in ``save_folder`` by name (batch, then epoch).

    Which of them was published last is ``foundry.checkpoint.find``'s answer, from their manifests.
    """
    save_folder = Path(save_folder)
    if not save_folder.is_dir():
        return []
    named = (path for path in save_folder.iterdir() if path.is_dir() and CHECKPOINT_NAME.match(path.name))
    return sorted(named, key=folder_order)


def folder_order(path: Path) -> tuple[int, int]:
    """(batch, epoch) of an ``ep*-ba*`` folder name."""
    match = CHECKPOINT_NAME.match(path.name)
    return (int(match.group(2)), int(match.group(1))) if match else (-1, -1)


def owner_rank(file_name: str) -> int | None:
    """The rank that writes ``file_name`` of a checkpoint (its RNG or tensor file), or None for shared files."""
    match = _RANK_FILE.match(file_name)
    return int(match.group(1) or match.group(2)) if match else None


# ------------------------------------------------------------------------------ reading, defensively
def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (meta.json, rng-rank<r>.json); a ``CheckpointError`` naming the file when it is
    missing, unreadable, not UTF-8 JSON or not an object, never a traceback."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"Cannot read {path} ({error.strerror or error}); load another checkpoint.") from None
    return parse_json_object(data, str(path))


def parse_json_object(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object in ``data``, read from ``where`` (a file, or an object-store key); ``CheckpointError`` if
    it is not UTF-8 JSON or not an object."""
    try:
        value = json.loads(data)
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError alike
        raise CheckpointError(
            f"{where} is not valid JSON ({type(error).__name__}: {str(error)[:120]}): the file is damaged. Load "
            "another checkpoint (load_path), or let autoresume: true fall back to the newest intact one."
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} holds a JSON {type(value).__name__}, not an object: the file is damaged.")
    return value


def read_pointer(save_folder: Path) -> str | None:
    """The checkpoint name ``<save_folder>/latest`` holds, or None: absent, or damaged (a warning says so; nothing
    relies on the pointer, so a damaged one is only rewritten at the next publish)."""
    pointer = save_folder / LATEST_FILE
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        log.warning("Ignoring %s: it cannot be read (%s); it is rewritten at the next save.", pointer, error)
        return None
    if not CHECKPOINT_NAME.match(name):
        log.warning("Ignoring %s: it names no checkpoint (%r); it is rewritten at the next save.", pointer, name[:40])
        return None
    return name


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


def write_durably(path: Path, text: str, tmp_name: str | None = None) -> None:
    """Write and fsync ``path``; with ``tmp_name``, via a temporary file renamed over it (atomic)."""
    target = path.with_name(tmp_name) if tmp_name else path
    with open(target, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    if tmp_name:
        os.replace(target, path)
        fsync_dir(path.parent)


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (``.damaged-2``... when taken), out of every reader's way;
    the new path."""
    aside = folder.with_name(folder.name + DAMAGED_SUFFIX)
    copies = 1
    while aside.exists():
        copies += 1
        aside = folder.with_name(f"{folder.name}{DAMAGED_SUFFIX}-{copies}")
    os.replace(folder, aside)
    return aside


def move_into_place(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished checkpoint folder into place (replacing an older one of the same name)."""
    if final_dir.exists():
        old_dir = final_dir.with_name(f"{TMP_PREFIX}old-{final_dir.name}-{secrets.token_hex(4)}")
        os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def fsync_dir(folder: Path) -> None:
    # A rename survives power loss only once its folder is synced too; not every OS allows this.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
