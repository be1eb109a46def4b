"""Writing checkpoints: atomically (a temporary folder renamed into place), optionally in the background.

``start_checkpoint`` gathers the run's state and begins the write (each rank then hashes the files
it wrote); ``PendingCheckpoint.finish()`` publishes it: rank 0 writes ``manifest.json`` (every
file's checksum and the publish sequence), renames the folder into place, updates ``latest`` and
prunes. ``save_checkpoint`` does both. A kill at any instant leaves either the previous checkpoints
and a ``.tmp-*`` folder, or the new checkpoint complete (``foundry.checkpoint.kill_points`` names
those instants). The folder layout is described in ``foundry.checkpoint.layout``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib.metadata
import json
import math
import os
import platform
import secrets
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from foundry.checkpoint.find import checkpoint_folders
from foundry.checkpoint.hooks import checkpoint_hooks
from foundry.checkpoint.integrity import hash_files, manifest_text, publish_sequence
from foundry.checkpoint.kill_points import kill_point
from foundry.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST_FILE,
    MANIFEST_FILE,
    META_FILE,
    TMP_PREFIX,
    checkpoint_name,
    move_into_place,
    read_pointer,
    root_cause,
    single_process_quiet,
    stateful_key_pairs,
    tensor_state,
    write_durably,
)
from foundry.checkpoint.meta import model_section_of, tokenizer_section_of
from foundry.checkpoint.rng import get_rng_state, rng_file_name
from foundry.checkpoint.safe_reader import METADATA_FILE
from foundry.core.redact import scrub_secrets
from foundry.core.state import State
from foundry.errors import CheckpointError


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
    first_sequence: int = 1,
) -> PendingCheckpoint:
    """Begin writing ``state`` as ``save_checkpoint`` does; ``finish()`` on the result publishes it.

    With ``async_process_group`` (a gloo group of every rank, used by nothing else) the tensors are
    copied to host memory and written by a background thread while training goes on; without it
    they are written before this returns. ``first_sequence``: the least publish sequence it may get (an
    object store's save_folder may hold newer checkpoints than its local copy).
    """
    save_folder = Path(save_folder)
    name = checkpoint_name(state.timestamp)
    final_dir = save_folder / name
    if final_dir.exists() and not overwrite:
        raise CheckpointError(
            f"Checkpoint {final_dir} already exists. Set save_overwrite: true to replace it, "
            "or choose another save_folder."
        )
    hooks = checkpoint_hooks(state.model)
    if refusals := [refusal for refusal in _gather(hooks.save_refusal(state.model)) if refusal]:
        raise CheckpointError(refusals[0])  # on every rank, before any rank writes
    rng_json = json.dumps(get_rng_state())  # first, so nothing below can draw from the generators before
    tensors = tensor_state(state, frozen=hooks.saves_frozen_weights())
    tensors["model"] = hooks.state_to_save(tensors["model"])  # maybe part of the weights
    meta_json = _meta_json(state, name, callbacks, algorithms, config)

    if state.rank == 0:
        save_folder.mkdir(parents=True, exist_ok=True)
        remove_temporaries(save_folder)
    tmp_dir = save_folder / _same_on_all_ranks(f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}")
    _barrier()
    kill_point("save.started")
    pending = PendingCheckpoint(tmp_dir, final_dir, state.rank, num_to_keep, first_sequence)
    try:
        pending.write = _write_checkpoint(tmp_dir, tensors, meta_json, rng_json, state.rank, async_process_group)
    except (Exception, dcp.CheckpointException) as exc:
        pending.fail(exc)
    return pending


class PendingCheckpoint:
    """A checkpoint being written into its temporary folder; ``finish()`` publishes it once complete."""

    def __init__(self, tmp_dir: Path, final_dir: Path, rank: int, num_to_keep: int, first_sequence: int = 1) -> None:
        self.tmp_dir, self.final_dir, self.rank, self.num_to_keep = tmp_dir, final_dir, rank, num_to_keep
        self.first_sequence = first_sequence
        self.write: Future | None = None  # the write (and hashing) of this rank's files: its hashes

    def wait(self) -> dict[str, dict]:
        """Wait until this rank's files are written and hashed; their hashes (``CheckpointError`` if that failed)."""
        write, self.write = self.write, None
        try:
            return write.result() if write is not None else {}
        except (Exception, dcp.CheckpointException) as exc:
            self.fail(exc)

    def finish(self) -> Path:
        """Wait for the write, then write the manifest, rename the checkpoint into place, update ``latest``, prune.

        Every rank must call it. Returns the checkpoint folder.
        """
        every_ranks_hashes = _gather(self.wait())
        if self.rank == 0:
            save_folder = self.final_dir.parent
            files = _with_unclaimed_files(self.tmp_dir, every_ranks_hashes)
            sequence = max(_next_sequence(save_folder), self.first_sequence)
            write_durably(self.tmp_dir / MANIFEST_FILE, manifest_text(files, sequence))
            kill_point("publish.manifest_written")
            move_into_place(self.tmp_dir, self.final_dir)
            kill_point("publish.renamed")
            complete_publish(save_folder, self.final_dir.name, self.num_to_keep)
        _barrier()
        return self.final_dir

    def fail(self, exc: BaseException) -> NoReturn:
        out_of_space = _out_of_space(exc, self.final_dir.parent)  # before the partial files are removed
        if self.rank == 0:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        cause = root_cause(exc)
        if out_of_space:
            raise CheckpointError(
                f"Could not write checkpoint {self.final_dir}: no space left on device in {self.final_dir.parent} "
                f"({type(cause).__name__}: {cause}). Free space there, lower save_num_checkpoints_to_keep, or point "
                "save_folder at a larger disk; the earlier checkpoints there are untouched."
            ) from exc
        raise CheckpointError(
            f"Could not write checkpoint {self.final_dir} ({type(cause).__name__}: {cause}). Check free disk space "
            f"and write permission in {self.final_dir.parent}; earlier checkpoints there are untouched."
        ) from exc


_NEARLY_FULL_BYTES = 1 << 20  # torch's zip writer reports a full disk as "unexpected pos N vs M", not ENOSPC


def _out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of disk space: ENOSPC anywhere in its causes, or (torch does not pass the
    OSError on) less than a MiB left in ``folder``'s file system."""
    for error in (exc, root_cause(exc)):
        while error is not None:
            if isinstance(error, OSError) and error.errno == errno.ENOSPC:
                return True
            error = error.__cause__ or error.__context__
    try:
        return shutil.disk_usage(folder).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _write_checkpoint(
    folder: Path,
    tensors: dict[str, Any],
    meta_json: str,
    rng_json: str,
    rank: int,
    async_process_group: dist.ProcessGroup | None,
) -> Future | None:
    """Write the checkpoint's files into ``folder``, then hash this rank's; the result holds the hashes.

    With a process group the tensors are written (and the files hashed) in the background.
    """
    folder.mkdir(parents=True, exist_ok=True)
    write_durably(folder / rng_file_name(rank), rng_json)
    if rank == 0:
        write_durably(folder / META_FILE, meta_json)
    kill_point("save.metadata_written")
    writer = dcp.FileSystemWriter(folder)

    def hash_own_files() -> dict[str, dict]:
        kill_point("save.tensors_written")
        hashes = hash_files(folder, _own_files(folder, rank))
        kill_point("save.hashed")
        return hashes

    if async_process_group is not None:
        return _then(dcp.async_save(tensors, storage_writer=writer, process_group=async_process_group), hash_own_files)
    with single_process_quiet():
        dcp.save(tensors, storage_writer=writer)
    done: Future = Future()
    done.set_result(hash_own_files())
    return done


def _own_files(folder: Path, rank: int) -> list[str]:
    """The files rank ``rank`` wrote: its RNG file, its tensor files (DCP names them ``__<rank>_*``) and,
    on rank 0, meta.json and DCP's .metadata. Rank 0 hashes any file no rank claims when it publishes."""
    own = [rng_file_name(rank)] + ([META_FILE, METADATA_FILE] if rank == 0 else [])
    return own + sorted(path.name for path in folder.glob(f"__{rank}_*") if path.is_file())


def _with_unclaimed_files(folder: Path, hashes_by_rank: list[dict[str, dict]]) -> dict[str, dict]:
    files = {name: entry for hashes in hashes_by_rank for name, entry in hashes.items()}
    unclaimed = sorted(path.name for path in folder.iterdir() if path.is_file() and path.name not in files)
    return {**files, **hash_files(folder, unclaimed)}


def _then(future: Future, step: Callable[[], Any]) -> Future:
    """A future of ``step()``, run (in the thread that completes ``future``) once ``future`` succeeded."""
    chained: Future = Future()

    def run_step(done: Future) -> None:
        try:
            done.result()
            chained.set_result(step())
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            chained.set_exception(exc)

    future.add_done_callback(run_step)
    return chained


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
        "model": _checked_json(model_section_of(state.model), "the model's config"),
        "tokenizer": tokenizer_section_of(state.tokenizer),
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


def _stateful_states(objects: Sequence) -> dict[str, Any]:
    states = {}
    for key, obj in stateful_key_pairs(objects):
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


# ------------------------------------------------------------------------------- folder upkeep
def _next_sequence(save_folder: Path) -> int:
    """One more than the highest publish sequence in ``save_folder`` (those of damaged manifests unknown)."""
    known = [sequence for path in checkpoint_folders(save_folder) if (sequence := publish_sequence(path)) != math.inf]
    return int(max(known, default=0)) + 1


def complete_publish(save_folder: Path, name: str, num_to_keep: int) -> None:
    """The steps after checkpoint ``name`` is in place: ``latest`` names it, and only ``num_to_keep`` are kept.

    Run by rank 0 after each publish, and again when a run resumes from its newest checkpoint: a kill
    between the rename and these steps leaves them undone, and the resumed run may have nothing left
    to save (it was killed at its last checkpoint) that would do them.
    """
    if read_pointer(save_folder) != name:
        write_durably(save_folder / LATEST_FILE, name, tmp_name=f"{TMP_PREFIX}{LATEST_FILE}-{secrets.token_hex(4)}")
    kill_point("publish.latest_written")
    _prune(save_folder, num_to_keep, keep_name=name)


def _prune(save_folder: Path, num_to_keep: int, keep_name: str) -> None:
    """Delete all but the ``num_to_keep`` last published checkpoints; never ``keep_name``, the one just written."""
    if num_to_keep < 0:
        return
    older = [path for path in checkpoint_folders(save_folder) if path.name != keep_name]
    num_older_to_keep = max(num_to_keep - 1, 0)
    for path in older[: len(older) - num_older_to_keep]:
        # Rename first: a crash mid-delete then leaves a .tmp-* folder, never a half-deleted checkpoint.
        doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}")
        os.replace(path, doomed)
        kill_point("prune.renamed")
        shutil.rmtree(doomed, ignore_errors=True)


def remove_temporaries(save_folder: Path) -> None:
    """Delete what interrupted saves left behind (``.tmp-*``). Only while no save into the folder runs."""
    for path in save_folder.glob(f"{TMP_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------- distributed
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (also a barrier)."""
    if not _distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _same_on_all_ranks(value: str) -> str:
    """Rank 0's ``value`` on every rank (all ranks must write into the same temporary folder)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
