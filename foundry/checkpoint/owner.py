"""Whose checkpoints a save_folder holds: a run writes only into a folder that is empty or holds its own.

A checkpoint names the run that saved it (``meta.json``: ``run.run_name``). A run refuses a save_folder
whose newest checkpoint another run saved: its saves would mix with them, and retention would delete
them. A run that sets no ``run_name`` gets a new generated one at each launch, so with ``autoresume`` it
cannot be told from the run it continues: it resumes, as before. Without ``autoresume`` a run would start
from batch 0 in a folder that already holds checkpoints (of any run) and stop at its first save of a name
already there: it is refused at once instead. ``save_overwrite`` and ``load_path`` say the user means it.
"""

from __future__ import annotations

from pathlib import Path

from foundry.checkpoint.config import CheckpointConfig
from foundry.checkpoint.integrity import checkpoint_folders
from foundry.checkpoint.layout import META_FILE
from foundry.checkpoint.meta import parse_meta, read_meta, run_name_of
from foundry.checkpoint.object_store import ObjectStore, object_store
from foundry.checkpoint.remote import published_checkpoints
from foundry.core.paths import check_writable_folder, is_object_store_url, local_copy
from foundry.core.run_name import is_generated_run_name
from foundry.errors import CheckpointError, ConfigError


def check_save_folder(config: CheckpointConfig, run_name: str) -> None:
    """Raise ``ConfigError`` unless this run may write into ``config.save_folder`` (``{run_name}`` filled in):
    its folder (an object store's local copy) is writable by this process, and it holds no other run's
    checkpoints, per the module's docstring. Every rank calls it: all of them stop, or none."""
    save_folder = config.save_folder
    on_store = is_object_store_url(save_folder)
    check_writable_folder(local_copy(save_folder) if on_store else save_folder, "save_folder")
    if config.save_overwrite or config.load_path:
        return
    if on_store:
        newest = newest_on_store(object_store(save_folder), local_copy(save_folder))
    else:
        newest = newest_in_folder(Path(save_folder))
    if newest is None:
        return
    name, saved_by = newest
    named = not is_generated_run_name(run_name)
    if config.autoresume and (saved_by is None or saved_by == run_name or not named):
        return
    others = f"checkpoints of another run, '{saved_by}'" if saved_by != run_name else "checkpoints of this run"
    others = others if saved_by is not None else "checkpoints of a run that did not record its name"
    if config.autoresume:
        continuing = f"set run_name: {saved_by} to continue that run"
    else:
        continuing = "set autoresume: true to continue from its newest checkpoint"
    raise ConfigError(
        f"save_folder {save_folder} holds {others} (newest: {name}), and this run is '{run_name}'"
        f"{'' if config.autoresume else ', without autoresume'}: it would train from batch 0 and write among them "
        f"(its first save of a name already there stops it, and retention would delete them). Give this run a new "
        f"save_folder, or {continuing}, or set save_overwrite: true to write over them, or load_path: "
        f"{save_folder.rstrip('/')}/{name} to start from its weights (best with a new save_folder)."
    )


def newest_in_folder(folder: Path) -> tuple[str, str | None] | None:
    """The newest checkpoint of a local save_folder and the run that saved it, or None."""
    folders = checkpoint_folders(folder)
    if not folders:
        return None
    try:
        return folders[-1].name, run_name_of(read_meta(folders[-1]))
    except CheckpointError:  # unreadable: the loader says why, if it is ever loaded
        return folders[-1].name, None


def newest_on_store(store: ObjectStore, local_folder: Path) -> tuple[str, str | None] | None:
    """The newest checkpoint the store publishes (else the newest of its local copy) and the run that saved it."""
    published = published_checkpoints(store)
    if not published:
        return newest_in_folder(local_folder)
    name = published[-1][0]
    try:
        return name, run_name_of(parse_meta(store.read_bytes(f"{name}/{META_FILE}"), f"{name}/{META_FILE}"))
    except CheckpointError:
        return name, None
