"""Checks of the paths a run writes and reads, made before any model or loader is built."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from foundry.errors import ConfigError, FoundryError

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_local_path(path: str | None, key: str, error: type[FoundryError] = ConfigError) -> None:
    """Refuse a URL (``s3://``, ``gs://``, ``oci://``, ``azure://``...): checkpoints are local folders for now."""
    match = _URL_SCHEME.match(path or "")
    if match:
        raise error(
            f"{key} is '{path}', a {match.group(1)}:// URL, but foundry reads and writes checkpoints in local "
            "folders only (object stores are not supported yet). Give a local or mounted path (e.g. a folder on "
            "shared storage, or a bucket mounted with a FUSE driver) and copy checkpoints to the store from there."
        )


def check_writable_folder(path: str, key: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``path`` is, or can be created as, a folder this process writes.

    Nothing is created: a probe file goes into the folder, or into its nearest existing parent, and is removed.
    """
    check_local_path(path, f"'{key}'")
    folder = Path(path)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"'{key}' is '{path}', but {existing} is a file, so the folder cannot be created there. Choose another "
            f"'{key}'."
        )
    probe = existing / f".tmp-write-check-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.write_bytes(b"")
        probe.unlink(missing_ok=True)  # rank 0 may have cleared .tmp-* files of the save folder meanwhile
    except OSError as exc:
        raise ConfigError(
            f"'{key}' is '{path}', but this process cannot write in {existing} ({exc.strerror or exc}). Choose a "
            f"folder you can write to, or fix its permissions, before training starts."
        ) from None
