"""Per-file checksums of a checkpoint: written when it is saved, checked before any of it is read.

``manifest.json`` lists every file of the checkpoint with its size and xxh3-64 digest, and the
checkpoint's publish ``sequence`` (one more than the highest in its save_folder when it was
published), which orders checkpoints by when they were published whatever their names. It also
holds a digest of its own entries, so damage to the manifest is told apart from damage to a file.

``verify_checkpoint`` compares every file with the manifest before anything is read: a missing,
truncated or altered file (one flipped byte) raises ``DamagedCheckpointError`` naming it. With
``collective=True`` every rank checks a share of the files and all ranks raise the same error.
Checkpoints written before manifests existed (``format_version`` 1) load with a warning.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from foundry.checkpoint.layout import MANIFEST_FILE, folder_order, named_folders
from foundry.checkpoint.meta import format_version
from foundry.checkpoint.safe_reader import METADATA_FILE
from foundry.distributed.env import all_gather_object, get_rank, get_world_size
from foundry.errors import CheckpointError, DamagedCheckpointError

log = logging.getLogger(__name__)

HASH_NAME = "xxh3_64"
_CHUNK_BYTES = 8 << 20
_MAX_LISTED_PROBLEMS = 3

# Folders verified in this process, with the (name, size, mtime) of each file when they were.
_verified: dict[Path, tuple] = {}


@dataclass(frozen=True)
class Manifest:
    sequence: int
    files: dict[str, dict[str, Any]]  # name -> {"bytes": n, "xxh3_64": hex digest}


# ---------------------------------------------------------------------------------------- write
def file_entry(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_64": digest}`` of one file."""
    digest = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, HASH_NAME: digest.hexdigest()}


def hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_entry(folder / name) for name in names}


def manifest_text(files: dict[str, dict[str, Any]], sequence: int) -> str:
    """The manifest of ``files`` (name -> ``file_entry``), to be written as ``manifest.json``."""
    body: dict[str, Any] = {"format_version": 1, "sequence": sequence, "hash": HASH_NAME}
    body["files"] = dict(sorted(files.items()))
    body["manifest_digest"] = _own_digest(body)
    return json.dumps(body, indent=1)


def _own_digest(body: dict[str, Any]) -> str:
    entries = {key: value for key, value in body.items() if key != "manifest_digest"}
    return xxhash.xxh3_64(json.dumps(entries, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------- read
class _UnreadableManifest(Exception):
    """The manifest itself is damaged; the message says how."""


def _read_manifest(folder: Path) -> Manifest | None:
    """The checkpoint's manifest; None when it has none."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_bytes())
        files, sequence = body["files"], body["sequence"]
        intact = body.get("manifest_digest") == _own_digest(body) and isinstance(sequence, int)
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as exc:
        raise _UnreadableManifest(f"{MANIFEST_FILE} is unreadable ({type(exc).__name__})") from None
    if not intact:
        raise _UnreadableManifest(f"{MANIFEST_FILE} does not match its own checksum")
    if not isinstance(files, dict) or not all(map(_valid_entry, files.items())):
        raise _UnreadableManifest(f"{MANIFEST_FILE} lists an entry that is not a file of this folder with its checksum")
    return Manifest(sequence=sequence, files=files)


def _valid_entry(item: tuple[Any, Any]) -> bool:
    name, entry = item
    plain_name = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
    return plain_name and isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and HASH_NAME in entry


def read_manifest(folder: Path) -> Manifest:
    """The manifest of checkpoint ``folder``; ``DamagedCheckpointError`` when it is missing or damaged."""
    try:
        manifest = _read_manifest(folder)
    except _UnreadableManifest as problem:
        raise damaged(folder, [str(problem)]) from None
    if manifest is None:
        raise damaged(folder, [f"{MANIFEST_FILE} is missing"])
    return manifest


def publish_sequence(folder: Path) -> float:
    """When ``folder`` was published, for ordering: its manifest's sequence. A checkpoint of an older foundry
    (no manifest, format_version 1) comes before all others (0); one whose manifest is damaged or missing
    comes after all (infinity), so that a resume meets it first, says why it skips it and sets it aside."""
    try:
        manifest = _read_manifest(folder)
    except _UnreadableManifest:
        return math.inf
    if manifest is not None:
        return manifest.sequence
    return 0 if format_version(folder) == 1 else math.inf


def checkpoint_folders(save_folder: str | Path) -> list[Path]:
    """The ``ep*-ba*`` checkpoints in ``save_folder``, oldest first: in publish order, then by batch."""
    return sorted(named_folders(save_folder), key=lambda path: (publish_sequence(path), *folder_order(path)))


# --------------------------------------------------------------------------------------- verify
def verify_checkpoint(folder: Path, collective: bool = False) -> None:
    """Raise ``DamagedCheckpointError`` unless every file of checkpoint ``folder`` is as it was saved.

    ``collective``: every rank of the process group calls this; each hashes a share of the files.
    """
    folder = Path(folder)
    key = folder.resolve()
    try:
        manifest = _read_manifest(folder)
    except _UnreadableManifest as problem:
        raise damaged(folder, [str(problem)]) from None
    if manifest is None:
        _check_unverifiable(folder)
        return
    names = sorted(manifest.files)
    if not collective and _verified.get(key) == _signature(folder, names):
        return
    if collective:
        share = names[get_rank() :: get_world_size()]
        problems = [problem for found in all_gather_object(_damage(folder, manifest, share)) for problem in found]
    else:
        problems = _damage(folder, manifest, names)
    if problems:
        raise damaged(folder, problems)
    _verified[key] = _signature(folder, names)


def _damage(folder: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """What differs from the manifest among ``names``: one line per damaged file."""
    problems = []
    for name in names:
        expected = manifest.files[name]
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected.get("bytes"):
            problems.append(f"{name} has {size} bytes where {expected.get('bytes')} were written")
        elif file_entry(path)[HASH_NAME] != expected.get(HASH_NAME):
            problems.append(f"{name} differs from its checksum (its contents were altered)")
    return problems


def _signature(folder: Path, names: list[str]) -> tuple:
    stats = []
    for name in [MANIFEST_FILE, *names]:
        try:
            stat = (folder / name).stat()
        except OSError:
            return ()
        stats.append((name, stat.st_size, stat.st_mtime_ns))
    return tuple(stats)


def _check_unverifiable(folder: Path) -> None:
    """A checkpoint without a manifest: one of an older foundry (loads, with a warning), else damaged."""
    if format_version(folder) != 1:
        raise damaged(folder, [f"{MANIFEST_FILE} is missing"])
    if not (folder / METADATA_FILE).is_file():
        raise damaged(folder, [f"{METADATA_FILE} is missing"])
    log.warning(
        "Checkpoint %s was written by an older foundry, without checksums: its files cannot be verified.", folder
    )


def damaged(folder: Path, problems: list[str]) -> DamagedCheckpointError:
    """The error for a damaged checkpoint: what is wrong, and which other checkpoints sit beside it."""
    listed = "; ".join(problems[:_MAX_LISTED_PROBLEMS])
    more = f" (and {len(problems) - _MAX_LISTED_PROBLEMS} more)" if len(problems) > _MAX_LISTED_PROBLEMS else ""
    others = [path.name for path in named_folders(folder.parent) if path != folder]
    alternatives = f"Other checkpoints in {folder.parent}: {', '.join(others)}. " if others else ""
    return DamagedCheckpointError(
        f"Checkpoint {folder} is damaged: {listed}{more}. Its files no longer match the checksums written when it "
        f"was saved (a storage or copy fault, or a changed file), so nothing of it is loaded. {alternatives}"
        "Load an earlier checkpoint (load_path), or let autoresume: true fall back to the newest intact one.",
        problems,
    )


def no_intact_checkpoint(location: str, skipped: list[tuple[str, DamagedCheckpointError]]) -> CheckpointError:
    """Autoresume's error when every checkpoint in ``location`` (a folder or a store URL) is damaged."""
    found = "; ".join(f"{name}: {', '.join(damage.problems)}" for name, damage in skipped)
    return CheckpointError(
        f"autoresume found no intact checkpoint in {location}, only damaged ones ({found}): their files no longer "
        "match the checksums written when they were saved. Restore one from a copy, or move these folders away "
        "to start the run afresh."
    )
