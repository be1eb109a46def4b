"""Whole-run checkpoints: written atomically, loaded without unpickling code, resumed exactly.

A checkpoint is a folder ``<save_folder>/ep{epoch}-ba{batch}/``::

    .metadata, __*.distcp   model and optimizer tensors (torch.distributed.checkpoint, any sharding)
    meta.json               timestamp, schedulers, callbacks, algorithms, dataloader, config, run info
    rng-rank{r}.json        each rank's random generators

It is written into ``.tmp-<name>-<random>/`` and renamed into place only when complete, so a run
killed mid-save leaves just a ``.tmp-*`` folder: readers ignore it and the next save deletes it.
``<save_folder>/latest`` names the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from foundry.checkpoint.rng import get_rng_state, load_rng_file, rng_file_for_rank, rng_file_name
from foundry.checkpoint.safe_reader import METADATA_FILE, SafeFileSystemReader, SafeLoadPlanner
from foundry.core.redact import scrub_secrets
from foundry.core.state import State
from foundry.core.time import Timestamp
from foundry.errors import CheckpointError
from foundry.peft.checkpoint import loadable_without, model_state_to_save

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "meta.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
_CHECKPOINT_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")


def checkpoint_name(timestamp: Timestamp) -> str:
    return f"ep{timestamp.epoch}-ba{timestamp.batch}"


# ------------------------------------------------------------------------------------ save
def save_checkpoint(save_folder: str | Path, state: State, **options: Any) -> Path:
    """Write ``state`` to ``<save_folder>/ep{epoch}-ba{batch}/``, point ``latest`` at it, prune old ones.

    ``start_checkpoint`` and its ``finish()`` in one call; ``options`` are ``start_checkpoint``'s
    (``callbacks``, ``algorithms``, ``config``, ``overwrite``, ``num_to_keep``). Every rank must call
    this (tensors are gathered collectively). Returns the checkpoint folder.
    """
    return start_checkpoint(save_folder, state, **options).finish()


def start_checkpoint(
    save_folder: str | Path,
    state: State,
    *,
    callbacks: Sequence = (),
    algorithms: Sequence = (),
    config: dict | None = None,
    overwrite: bool = False,
    num_to_keep: int = -1,
    async_process_group: dist.ProcessGroup | None = None,
) -> PendingCheckpoint:
    """Begin writing ``state`` as ``save_checkpoint`` does; ``finish()`` on the result publishes it.

    With ``async_process_group`` (a gloo group of every rank, used by nothing else) the tensors are
    copied to host memory and written by a background thread while training goes on; without it
    they are written before this returns.
    """
    save_folder = Path(save_folder)
    name = checkpoint_name(state.timestamp)
    final_dir = save_folder / name
    if final_dir.exists() and not overwrite:
        raise CheckpointError(
            f"Checkpoint {final_dir} already exists. Set save_overwrite: true to replace it, "
            "or choose another save_folder."
        )
    rng_json = json.dumps(get_rng_state())  # first, so nothing below can draw from the generators before
    tensors = _tensor_state(state)
    tensors["model"] = model_state_to_save(state.model, tensors["model"])  # LoRA: maybe the adapters alone
    meta_json = _meta_json(state, name, callbacks, algorithms, config)

    if state.rank == 0:
        save_folder.mkdir(parents=True, exist_ok=True)
        _remove_temporaries(save_folder)
    tmp_dir = save_folder / _same_on_all_ranks(f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}")
    _barrier()
    pending = PendingCheckpoint(tmp_dir, final_dir, state.rank, num_to_keep)
    try:
        pending.write = _write_checkpoint(tmp_dir, tensors, meta_json, rng_json, state.rank, async_process_group)
    except (Exception, dcp.CheckpointException) as exc:
        pending.fail(exc)
    return pending


class PendingCheckpoint:
    """A checkpoint being written into its temporary folder; ``finish()`` publishes it once complete."""

    def __init__(self, tmp_dir: Path, final_dir: Path, rank: int, num_to_keep: int) -> None:
        self.tmp_dir, self.final_dir, self.rank, self.num_to_keep = tmp_dir, final_dir, rank, num_to_keep
        self.write: Future | None = None  # the background write of the tensors, if any

    def wait(self) -> None:
        """Wait until this rank's tensors are written (raises ``CheckpointError`` if that failed)."""
        write, self.write = self.write, None
        if write is None:
            return
        try:
            write.result()
        except (Exception, dcp.CheckpointException) as exc:
            self.fail(exc)

    def finish(self) -> Path:
        """Wait for the write, then rename the checkpoint into place, point ``latest`` at it and prune.

        Every rank must call it. Returns the checkpoint folder.
        """
        self.wait()
        _barrier()
        if self.rank == 0:
            save_folder = self.final_dir.parent
            _publish(self.tmp_dir, self.final_dir)
            latest_tmp_name = f"{TMP_PREFIX}{LATEST_FILE}-{secrets.token_hex(4)}"
            _write_durably(save_folder / LATEST_FILE, self.final_dir.name, tmp_name=latest_tmp_name)
            _prune(save_folder, self.num_to_keep, keep_name=self.final_dir.name)
        _barrier()
        return self.final_dir

    def fail(self, exc: BaseException) -> None:
        if self.rank == 0:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        cause = _root_cause(exc)
        raise CheckpointError(
            f"Could not write checkpoint {self.final_dir} ({type(cause).__name__}: {cause}). Check free disk space "
            f"and write permission in {self.final_dir.parent}; earlier checkpoints there are untouched."
        ) from exc


def _write_checkpoint(
    folder: Path,
    tensors: dict[str, Any],
    meta_json: str,
    rng_json: str,
    rank: int,
    async_process_group: dist.ProcessGroup | None,
) -> Future | None:
    """Write the checkpoint's files into ``folder``; the tensors in the background with a process group."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_durably(folder / rng_file_name(rank), rng_json)
    if rank == 0:
        _write_durably(folder / META_FILE, meta_json)
    writer = dcp.FileSystemWriter(folder)
    if async_process_group is not None:
        return dcp.async_save(tensors, storage_writer=writer, process_group=async_process_group)
    with _single_process_quiet():
        dcp.save(tensors, storage_writer=writer)
    return None


def _tensor_state(state: State, model_only: bool = False) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (``get_state_dict`` also handles FSDP2)."""
    if model_only or not state.optimizers:
        return {"model": get_model_state_dict(state.model)}
    model_state, optim_state = get_state_dict(state.model, state.optimizers)
    return {"model": model_state, "optim": optim_state}


def _meta_json(state: State, name: str, callbacks: Sequence, algorithms: Sequence, config: dict | None) -> str:
    meta = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "timestamp": state.timestamp.state_dict(),
        "schedulers": [_json_items(scheduler.state_dict()) for scheduler in state.schedulers],
        "callbacks": _stateful_states(callbacks),
        "algorithms": _stateful_states(algorithms),
        "dataloader": _dataloader_state(state.train_dataloader),
        "config": scrub_secrets(_checked_json(config, "the run config")),
        "run": _run_info(state),
    }
    return json.dumps(meta, indent=2)


def _run_info(state: State) -> dict[str, Any]:
    device = torch.device(state.device)
    device_name = platform.processor() or platform.machine()
    if device.type == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    return {
        "run_name": state.run_name,
        "world_size": state.world_size,
        "device_type": device.type,
        "device_name": device_name,
        "torch_version": torch.__version__,
        "foundry_version": _foundry_version(),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _foundry_version() -> str:
    try:
        return importlib.metadata.version("foundry")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _stateful_key_pairs(objects: Sequence) -> Iterator[tuple[str, Any]]:
    """Key objects by class name ("Foo", "Foo.1", ...) so adding another callback does not shift the rest."""
    seen: dict[str, int] = {}
    for obj in objects:
        class_name = type(obj).__name__
        count = seen.get(class_name, 0)
        seen[class_name] = count + 1
        yield (class_name if count == 0 else f"{class_name}.{count}"), obj


def _stateful_states(objects: Sequence) -> dict[str, Any]:
    states = {}
    for key, obj in _stateful_key_pairs(objects):
        object_state = obj.state_dict() if hasattr(obj, "state_dict") else {}
        if object_state:
            states[key] = _checked_json(object_state, f"{key}.state_dict()")
    return states


def _dataloader_state(dataloader: Any) -> dict | None:
    if not hasattr(dataloader, "state_dict"):
        return None
    return _checked_json(dataloader.state_dict(), f"{type(dataloader).__name__}.state_dict()")


def _checked_json(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"Cannot checkpoint {what}: it is not JSON-serialisable ({exc}). It must hold only numbers, "
            "strings, booleans, None, lists and dicts."
        ) from exc
    return value


def _json_items(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable entries of a scheduler's state (LambdaLR's lambdas, for one, are code)."""
    kept = {}
    for key, value in state_dict.items():
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(value)
            kept[key] = value
    return kept


# ---------------------------------------------------------------------------- folder upkeep
def _publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the finished checkpoint into place (replacing an older one of the same name)."""
    if final_dir.exists():
        old_dir = final_dir.with_name(f"{TMP_PREFIX}old-{final_dir.name}-{secrets.token_hex(4)}")
        os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)


def _prune(save_folder: Path, num_to_keep: int, keep_name: str) -> None:
    """Delete all but the ``num_to_keep`` newest checkpoints; never ``keep_name``, the one just written."""
    if num_to_keep < 0:
        return
    older = [path for path in _complete_checkpoints(save_folder) if path.name != keep_name]
    num_older_to_keep = max(num_to_keep - 1, 0)
    for path in older[: len(older) - num_older_to_keep]:
        # Rename first: a crash mid-delete then leaves a .tmp-* folder, never a half-deleted checkpoint.
        doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_temporaries(save_folder: Path) -> None:
    """Delete what interrupted saves left behind."""
    for path in save_folder.glob(f"{TMP_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _write_durably(path: Path, text: str, tmp_name: str | None = None) -> None:
    """Write and fsync ``path``; with ``tmp_name``, via a temporary file renamed over it (atomic)."""
    target = path.with_name(tmp_name) if tmp_name else path
    with open(target, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    if tmp_name:
        os.replace(target, path)
        _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # A rename survives power loss only once its folder is synced too; not every OS allows this.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _complete_checkpoints(save_folder: Path) -> list[Path]:
    """Complete ``ep*-ba*`` checkpoints in ``save_folder``, oldest first."""
    found = []
    for path in save_folder.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match and _is_complete(path):
            found.append(((int(match.group(2)), int(match.group(1))), path))
    return [path for _, path in sorted(found)]


def _is_complete(folder: Path) -> bool:
    return (folder / META_FILE).is_file() and (folder / METADATA_FILE).is_file()


# ------------------------------------------------------------------------------------ find
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
    complete = _complete_checkpoints(save_folder)
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


def _check_complete(folder: Path) -> None:
    for file_name in (META_FILE, METADATA_FILE):
        if not (folder / file_name).is_file():
            raise CheckpointError(
                f"Checkpoint {folder} has no {file_name}: the checkpoint is incomplete (its save was "
                "interrupted or files were removed). Load an earlier checkpoint from the same folder."
            )


# ------------------------------------------------------------------------------------ load
def load_checkpoint(
    path: str | Path,
    state: State,
    *,
    callbacks: Sequence = (),
    algorithms: Sequence = (),
    weights_only: bool = False,
    strict: bool = True,
) -> dict:
    """Restore ``state`` (and callbacks, algorithms) in place from a checkpoint; returns its meta.json.

    ``weights_only=True`` loads only the model (fine-tuning from a pretrained run). ``strict=False``
    tolerates model keys missing on either side.
    """
    path = resolve_checkpoint_path(path)
    meta = _read_meta(path)
    _load_tensors(path, state, weights_only=weights_only, strict=strict)
    if not weights_only:
        _restore_training_state(path, meta, state, callbacks, algorithms)
    return meta


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path / META_FILE} is not valid JSON ({exc}); load an earlier checkpoint.") from exc
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint {path} has format version {meta['format_version']}, newer than this foundry reads "
            f"({FORMAT_VERSION}). Upgrade foundry."
        )
    return meta


def _load_tensors(path: Path, state: State, *, weights_only: bool, strict: bool) -> None:
    reader = SafeFileSystemReader(path)
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    wanted = _tensor_state(state, model_only=weights_only)
    absent: set[str] = set()
    if strict:
        absent = _check_model_keys(path, set(wanted["model"]), saved_keys)
        wanted["model"] = {key: value for key, value in wanted["model"].items() if key not in absent}
    if "optim" in wanted and not any(key.startswith("optim.") for key in saved_keys):
        raise CheckpointError(
            f"Checkpoint {path} holds no optimizer state. Pass load_weights_only=True to load only its model."
        )
    try:
        with _single_process_quiet():
            dcp.load(wanted, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict))
    except (Exception, dcp.CheckpointException) as exc:
        cause = _root_cause(exc)
        if isinstance(cause, CheckpointError):
            raise cause from exc
        raise CheckpointError(
            f"Cannot load the tensors of checkpoint {path} ({type(cause).__name__}: {cause})."
        ) from exc
    options = StateDictOptions(strict=strict and not absent)
    if "optim" in wanted:
        set_state_dict(
            state.model,
            state.optimizers,
            model_state_dict=wanted["model"],
            optim_state_dict=wanted["optim"],
            options=options,
        )
    else:
        set_model_state_dict(state.model, wanted["model"], options=options)


def _check_model_keys(path: Path, model_keys: set[str], saved_keys: set[str]) -> set[str]:
    """The model keys the checkpoint may lack (LoRA adapters or their base); raises on any other mismatch."""
    saved_model_keys = {key.removeprefix("model.") for key in saved_keys if key.startswith("model.")}
    missing, unexpected = sorted(model_keys - saved_model_keys), sorted(saved_model_keys - model_keys)
    if not unexpected and loadable_without(missing, saved_model_keys):
        return set(missing)
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {path} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. Check that the model config "
            "matches the run that saved it, or load with strict=False to take only the keys both have."
        )


def _root_cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (a BaseException), else ``exc``."""
    for failure, _traceback in getattr(exc, "failures", {}).values():
        return failure
    return exc


def _restore_training_state(path: Path, meta: dict, state: State, callbacks: Sequence, algorithms: Sequence) -> None:
    saved_world_size = meta.get("run", {}).get("world_size", state.world_size)
    if saved_world_size != state.world_size:
        log.warning("Checkpoint %s was saved by %d ranks; resuming on %d.", path, saved_world_size, state.world_size)
    state.timestamp = Timestamp.from_state_dict(meta["timestamp"])
    _load_schedulers(path, state.schedulers, meta["schedulers"])
    load_rng_file(rng_file_for_rank(path, state.rank))
    saved_dataloader = meta.get("dataloader")
    if saved_dataloader is not None:
        if hasattr(state.train_dataloader, "load_state_dict"):
            state.train_dataloader.load_state_dict(saved_dataloader)
        else:
            log.warning("Checkpoint %s has dataloader state but this dataloader cannot load it.", path)
    _load_stateful(path, callbacks, meta.get("callbacks", {}))
    _load_stateful(path, algorithms, meta.get("algorithms", {}))


def _load_schedulers(path: Path, schedulers: Sequence, saved: list[dict]) -> None:
    if len(schedulers) != len(saved):
        raise CheckpointError(
            f"Checkpoint {path} has {len(saved)} LR scheduler(s) but this run has {len(schedulers)}. Use the "
            "same schedulers as the saved run, or load_weights_only=True to start schedules afresh."
        )
    for scheduler, saved_state in zip(schedulers, saved):
        # Merge over the live state: entries that were not JSON (e.g. lambdas) keep their current value.
        scheduler.load_state_dict({**scheduler.state_dict(), **saved_state})


def _load_stateful(path: Path, objects: Sequence, saved: dict[str, Any]) -> None:
    restored = set()
    for key, obj in _stateful_key_pairs(objects):
        if key in saved and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(saved[key])
            restored.add(key)
    if unused := sorted(set(saved) - restored):
        log.warning("Checkpoint %s has state for %s, which this run does not have.", path, unused)


# ----------------------------------------------------------------------------- distributed
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _same_on_all_ranks(value: str) -> str:
    """Rank 0's ``value`` on every rank (all ranks must write into the same temporary folder)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes one process: that is our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield
