"""Checks of the paths a run writes and reads, made before any model or loader is built."""

from __future__ import annotations

import os
import re
import secrets
import urllib.parse
from pathlib import Path

from foundry.core.run_name import fill_run_name
from foundry.errors import ConfigError, FoundryError

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

# Object stores a save_folder or load_path may name: those whose uploaders and downloaders ship with
# mosaicml-streaming, each with the optional extra that installs its SDK.
OBJECT_STORE_EXTRAS = {"s3": "s3", "gs": "gcs", "oci": "oci", "azure": "azure"}

CACHE_ENV = "FOUNDRY_CACHE_DIR"


def cache_dir() -> Path:
    """Where foundry keeps what it downloads: ``$FOUNDRY_CACHE_DIR``, default ``~/.cache/foundry``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "foundry")


def local_copy(url: str) -> Path:
    """The local folder mirroring object-store folder ``url``: checkpoints are written there, then uploaded,
    and downloaded there to be loaded. ``$FOUNDRY_CACHE_DIR/object_stores/<scheme>/<bucket>/<path>``
    (default ``~/.cache/foundry``)."""
    parsed = urllib.parse.urlparse(url)
    return cache_dir() / "object_stores" / parsed.scheme / parsed.netloc / parsed.path.strip("/")


def public_location(path: str | Path) -> str:
    """Where a user finds ``path``: the object-store URL of a folder in a store's local copy (the inverse of
    ``local_copy``), else the path itself. For messages only: code reads and writes the local copy."""
    try:
        relative = Path(path).resolve().relative_to((cache_dir() / "object_stores").resolve())
    except ValueError:
        return str(path)
    scheme, bucket, *rest = relative.parts
    return f"{scheme}://{bucket}/{'/'.join(rest)}"


def url_scheme(path: str | None) -> str | None:
    """``"s3"`` for ``s3://bucket/x``; None for a local path."""
    match = _URL_SCHEME.match(path or "")
    return match.group(1).lower() if match else None


def is_object_store_url(path: str | Path | None) -> bool:
    return isinstance(path, str) and url_scheme(path) in OBJECT_STORE_EXTRAS


def check_storage_path(path: str | None, key: str, error: type[FoundryError] = ConfigError) -> None:
    """Refuse a URL whose scheme is not an object store foundry reads and writes checkpoints on."""
    scheme = url_scheme(path)
    if scheme is not None and scheme not in OBJECT_STORE_EXTRAS:
        supported = ", ".join(f"{name}://" for name in OBJECT_STORE_EXTRAS)
        raise error(
            f"{key} is '{path}', a {scheme}:// URL, which foundry cannot read or write checkpoints on. Supported "
            f"object stores: {supported} (each with its extra, e.g. pip install 'foundry[s3]'); otherwise give a "
            "local or mounted folder."
        )


def check_writable_folder(path: str | Path, key: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``path`` is, or can be created as, a folder this process writes.

    Nothing is created: a probe file goes into the folder, or into its nearest existing parent, and is removed.
    """
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


def run_subfolder(template: str, run_folder: str | None, run_name: str) -> Path:
    """A callback's output folder: ``{run_folder}`` (``.`` when unset) and ``{run_name}`` filled in."""
    return Path(fill_run_name(template.replace("{run_folder}", run_folder or "."), run_name))
