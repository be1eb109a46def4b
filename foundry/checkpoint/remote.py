"""A save_folder on an object store: what is published there, publishing and pruning, fetching a checkpoint.

The store holds the same ``ep{e}-ba{b}/`` folders as a local save_folder. A checkpoint is written,
verified and published locally first, in the store folder's local copy (``local_copy``); then every
rank uploads the files it wrote (``foundry.checkpoint.uploader``) and rank 0 uploads
``manifest.json`` last: **a checkpoint is published on the store once its manifest is there.** A
folder without one (an upload killed midway) is ignored by every reader and deleted when the next
run saving there starts. Pruning deletes a manifest before the files it lists, so a kill midway
leaves an unpublished folder, never a published one with files missing. Reading downloads a
checkpoint into the local copy and verifies it against its manifest, as for a local one. A checkpoint a
run could not upload stays in the local copy; the next run saving there uploads it first
(``publish_local_copies``), so nothing is deleted before a newer checkpoint is on the store.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from foundry.checkpoint.integrity import (
    checkpoint_folders,
    no_intact_checkpoint,
    publish_sequence,
    read_manifest,
    verify_checkpoint,
)
from foundry.checkpoint.kill_points import kill_point
from foundry.checkpoint.layout import (
    CHECKPOINT_NAME,
    LATEST_FILE,
    MANIFEST_FILE,
    TMP_PREFIX,
    folder_order,
    move_into_place,
    set_aside,
)
from foundry.checkpoint.object_store import ObjectStore, object_store
from foundry.core.paths import local_copy
from foundry.distributed.env import all_gather_object, get_local_rank
from foundry.errors import CheckpointError, DamagedCheckpointError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- what is there
def store_checkpoints(store: ObjectStore) -> dict[str, list[str]]:
    """``{checkpoint name: its file names}`` of every ``ep*-ba*`` folder on the store, published or not."""
    folders: dict[str, list[str]] = defaultdict(list)
    for key in store.list():
        name, slash, file = key.partition("/")
        if slash and CHECKPOINT_NAME.match(name) and file and "/" not in file:
            folders[name].append(file)
    return dict(folders)


def published_checkpoints(store: ObjectStore, folders: dict[str, list[str]] | None = None) -> list[tuple[str, float]]:
    """(name, publish sequence) of each checkpoint published on the store (its manifest is there), oldest first.

    A damaged manifest sorts last (infinity), so that a resume meets it first and says why it skips it.
    """
    folders = store_checkpoints(store) if folders is None else folders
    sequences = {}
    with tempfile.TemporaryDirectory(prefix="foundry-manifests-") as scratch:
        for name, files in folders.items():
            if MANIFEST_FILE in files:
                store.download(f"{name}/{MANIFEST_FILE}", Path(scratch, name, MANIFEST_FILE))
                sequences[name] = publish_sequence(Path(scratch, name))
    ordered = sorted(sequences, key=lambda name: (sequences[name], *folder_order(Path(name))))
    return [(name, sequences[name]) for name in ordered]


def remove_unpublished(store: ObjectStore, folders: dict[str, list[str]]) -> None:
    """Delete the store's folders without a manifest: what uploads killed midway left. Only while none runs."""
    for name, files in sorted(folders.items()):
        if MANIFEST_FILE not in files:
            log.info("Deleting %s: an upload interrupted before it was published.", store.url_of(name))
            store.delete(f"{name}/{file}" for file in files)


# ---------------------------------------------------------------------------------------- write
def upload_files(store: ObjectStore, source: Path, name: str, files: list[str]) -> None:
    """Upload ``files`` of ``source`` into the store's folder ``name`` (not yet published)."""
    for file in files:
        store.upload(source / file, f"{name}/{file}")
        kill_point("upload.file_uploaded")


def publish_on_store(store: ObjectStore, folder: Path, latest: str | None = None) -> None:
    """Upload ``folder``'s manifest, which publishes it (its other files must be there already), then ``latest``
    (default: this checkpoint's name)."""
    kill_point("upload.files_uploaded")
    store.upload(folder / MANIFEST_FILE, f"{folder.name}/{MANIFEST_FILE}")
    kill_point("upload.published")
    with tempfile.TemporaryDirectory(prefix="foundry-latest-") as scratch:
        pointer = Path(scratch, LATEST_FILE)
        pointer.write_text(latest or folder.name)
        store.upload(pointer, LATEST_FILE)


def publish_local_copies(store: ObjectStore, local_folder: Path, published: list[tuple[str, float]]) -> list[str]:
    """Upload and publish every intact checkpoint of ``local_folder`` that the store has not published (a run that
    could not upload it left it there); their names, in publish order. Run by rank 0 alone, before training.

    A damaged one is set aside (``<name>.damaged``) with a warning; an upload that fails raises
    ``CheckpointError`` (the local copies stay).
    """
    on_store = {name for name, _ in published}
    local_only = [folder for folder in checkpoint_folders(local_folder) if folder.name not in on_store]
    if not local_only:
        return []
    newest = max([*published, *((folder.name, publish_sequence(folder)) for folder in local_only)], key=lambda x: x[1])
    uploaded = []
    for folder in local_only:
        try:
            verify_checkpoint(folder)
        except DamagedCheckpointError as damage:
            aside = set_aside(folder)
            log.warning(
                "Checkpoint %s was never uploaded to %s and is damaged (%s): it is not uploaded, and was renamed to "
                "%s (delete it once you no longer need it).",
                folder,
                store.url,
                "; ".join(damage.problems),
                aside.name,
            )
            continue
        upload_files(store, folder, folder.name, sorted(file for file in read_manifest(folder).files))
        publish_on_store(store, folder, latest=newest[0])
        uploaded.append(folder.name)
        log.warning(
            "Uploaded checkpoint %s to %s from the local copy %s: the run that saved it could not upload it.%s",
            folder.name,
            store.url,
            local_folder,
            " It is the newest checkpoint: autoresume resumes from it." if folder.name == newest[0] else "",
        )
    return uploaded


def prune_store(store: ObjectStore, num_to_keep: int, keep_name: str) -> list[str]:
    """Delete all but the ``num_to_keep`` last published checkpoints on the store (never ``keep_name``); their names."""
    if num_to_keep < 0:
        return []
    folders = store_checkpoints(store)
    older = [name for name, _ in published_checkpoints(store, folders) if name != keep_name]
    doomed = older[: len(older) - max(num_to_keep - 1, 0)]
    for name in doomed:
        store.delete([f"{name}/{MANIFEST_FILE}"])  # unpublished first
        kill_point("prune.unpublished")
        store.delete(f"{name}/{file}" for file in folders[name] if file != MANIFEST_FILE)
    return doomed


# ----------------------------------------------------------------------------------------- read
def fetch_from_url(url: str) -> Path:
    """The checkpoint an object-store URL names, downloaded into its local copy (every rank must call this).

    ``url`` is a checkpoint folder (``.../ep0-ba100``) or a save_folder (its last published checkpoint).
    The caller verifies the files.
    """
    parent, _, last = url.rstrip("/").rpartition("/")
    if CHECKPOINT_NAME.match(last):
        store, name = object_store(parent), last
        if MANIFEST_FILE not in store_checkpoints(store).get(name, []):
            raise CheckpointError(
                f"No published checkpoint at {url}: it has no {MANIFEST_FILE} (nothing was saved there, or its upload "
                "was interrupted). Point load_path at a published checkpoint, or at the save_folder to load its latest."
            )
    else:
        store = object_store(url)
        published = published_checkpoints(store)
        if not published:
            raise CheckpointError(
                f"{url} holds no published checkpoint (no ep*-ba*/{MANIFEST_FILE}). Point load_path at a checkpoint "
                "folder or at the save_folder of a run that saved one."
            )
        name = published[-1][0]
    return fetch_on_every_rank(store, name)


def newest_intact_on_store(url: str, rank: int) -> Path | None:
    """The last published checkpoint of the store folder ``url`` whose files match their checksums, downloaded; or None.

    Damaged ones are skipped with a warning (the store is left as it is: a resumed run publishes newer ones).
    Every rank must call this.
    """
    store = object_store(url)
    skipped: list[tuple[str, DamagedCheckpointError]] = []
    for name, _ in reversed(published_checkpoints(store)):
        try:
            folder = fetch_on_every_rank(store, name)
            verify_checkpoint(folder, collective=True)
        except DamagedCheckpointError as damage:
            skipped.append((name, damage))
            continue
        for damaged_name, damage in skipped if rank == 0 else []:
            log.warning(
                "autoresume skipped checkpoint %s, which is damaged (%s), and resumes from %s instead.",
                store.url_of(damaged_name),
                "; ".join(damage.problems),
                name,
            )
        return folder
    if skipped:
        raise no_intact_checkpoint(url, skipped)
    return None


def fetch_on_every_rank(store: ObjectStore, name: str) -> Path:
    """Checkpoint ``name`` of the store in its local copy, downloaded by each machine's first rank; all ranks
    raise the same error if that failed."""
    problem: tuple[bool, str, list[str]] | None = None
    if get_local_rank() == 0:
        try:
            fetch_checkpoint(store, name)
        except CheckpointError as error:
            problem = (isinstance(error, DamagedCheckpointError), str(error), getattr(error, "problems", []))
    for found in all_gather_object(problem):
        if found is not None:
            is_damaged, message, problems = found
            raise DamagedCheckpointError(message, problems) if is_damaged else CheckpointError(message)
    return local_copy(store.url) / name


def fetch_checkpoint(store: ObjectStore, name: str) -> Path:
    """Download checkpoint ``name`` into the local copy, unless an identical intact copy is already there."""
    local = local_copy(store.url) / name
    manifest_bytes = store.read_bytes(f"{name}/{MANIFEST_FILE}")
    if (local / MANIFEST_FILE).is_file() and (local / MANIFEST_FILE).read_bytes() == manifest_bytes:
        try:
            verify_checkpoint(local)
            return local
        except DamagedCheckpointError:
            log.info("The local copy %s is damaged; downloading it again.", local)
    staging = local.with_name(f"{TMP_PREFIX}download-{name}-{secrets.token_hex(4)}")
    staging.mkdir(parents=True)
    try:
        (staging / MANIFEST_FILE).write_bytes(manifest_bytes)
        for file in read_manifest(staging).files:
            store.download(f"{name}/{file}", staging / file)
        move_into_place(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local
