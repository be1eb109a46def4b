"""LLM Foundry's ICL task files and task lists, fetched on first use from its repository at a pinned commit.

LLM Foundry ships its eval data in its repository (``scripts/eval/local_data/<category>/<task>.jsonl``)
and its task lists beside it (``scripts/eval/yamls/tasks_v0.3.yaml``, ...). foundry reads the same
files: a task whose ``dataset_uri`` does not exist locally but ends in ``local_data/<category>/<file>``
(LLM Foundry's own ``eval/local_data/...`` paths included), and a task list named ``light``,
``v0.3``, ``tasks_v0.3`` or ``eval/yamls/tasks_v0.3.yaml``, come from, in this order:

1. ``$FOUNDRY_ICL_DATA`` (``foundry eval --icl-data DIR``): a copy of LLM Foundry's ``scripts/eval``
   folder, for machines without internet; nothing is fetched. A copy of its ``local_data`` folder alone
   serves the task files; the named lists are then read from a ``yamls/`` beside it, or the cache;
2. the cache, ``$FOUNDRY_CACHE_DIR/icl/<commit>/`` (default ``~/.cache/foundry``), each file checked
   against its recorded checksum once per process before use (and again if its size or time changes):
   a file that differs is fetched again;
3. the repository at the commit of ``icl_sources.json`` (or ``$FOUNDRY_ICL_URL``, a mirror with the same
   layout), checked against the checksum recorded there before it enters the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Literal

from foundry.core.paths import cache_dir
from foundry.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ICL_DATA_ENV = "FOUNDRY_ICL_DATA"  # a local copy of LLM Foundry's scripts/eval folder: offline
ICL_URL_ENV = "FOUNDRY_ICL_URL"  # a mirror of LLM Foundry's scripts/eval folder at the pinned commit
DOWNLOAD_TIMEOUT_S = 60
ListKind = Literal["icl_tasks", "eval_gauntlet"]
_LIST_PREFIX = {"icl_tasks": "tasks_", "eval_gauntlet": "eval_gauntlet_"}


@cache
def sources() -> dict:
    """``icl_sources.json``: the repository, the commit, the URL pattern and ``{path: checksum}``."""
    return json.loads((Path(__file__).parent / "icl_sources.json").read_text())


def recorded_path(text: str | Path) -> str | None:
    """The ``icl_sources.json`` path (``local_data/...`` or ``yamls/...``) that ``text`` names, if any."""
    text = str(text).replace("\\", "/")
    files = sources()["files"]
    for folder in ("local_data/", "yamls/"):
        if folder in text:
            candidate = folder + text.rsplit(folder, 1)[1]
            if candidate in files:
                return candidate
    return None


def task_list_path(value: str | Path, kind: ListKind) -> Path:
    """The YAML file behind ``icl_tasks: VALUE`` / ``eval_gauntlet: VALUE``: a local file, else LLM Foundry's list.

    Names: ``light`` / ``v0.3`` (with the kind's prefix, ``tasks_`` or ``eval_gauntlet_``), the full
    stem (``tasks_v0.3``) or LLM Foundry's relative path (``eval/yamls/tasks_v0.3.yaml``).
    """
    path = Path(value).expanduser()
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml")
    for name in (f"{_LIST_PREFIX[kind]}{stem}", stem):
        if f"yamls/{name}.yaml" in sources()["files"]:
            return local_file(f"yamls/{name}.yaml")
    raise ConfigError(
        f"'{value}' is neither a file (looked in {path.resolve().parent}) nor one of LLM Foundry's {kind} lists "
        f"({', '.join(list_names(kind))}, or their file names). Check the path or the name."
    )


def list_names(kind: ListKind) -> list[str]:
    """The short names ``task_list_path`` takes for ``kind`` (``light``, ``v0.3``, ...)."""
    prefix = f"yamls/{_LIST_PREFIX[kind]}"
    return [path.removeprefix(prefix).removesuffix(".yaml") for path in sources()["files"] if path.startswith(prefix)]


def local_file(recorded: str) -> Path:
    """The local copy of a recorded file: from ``$FOUNDRY_ICL_DATA``, the cache, or downloaded into the cache."""
    offline = os.environ.get(ICL_DATA_ENV)
    cached = cache_dir() / "icl" / sources()["commit"] / recorded
    if offline:
        return _offline_copy(Path(offline).expanduser(), recorded, cached)
    if not cached.is_file():
        _download(recorded, cached)
    elif not _cached_file_intact(cached, recorded):
        log.warning("The cached %s does not match its recorded checksum; fetching it again.", cached)
        try:
            _download(recorded, cached)
        except DataError as error:
            raise DataError(
                f"The cached {cached} does not match the checksum icl_sources.json records for it (it was altered or "
                f"damaged), and fetching it again failed: {error}"
            ) from None
    return cached


_intact: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) → the checksum of the recorded file it matched


def _cached_file_intact(cached: Path, recorded: str) -> bool:
    """Whether ``cached`` holds the recorded bytes (hashed once per process while its size and time stay)."""
    expected = sources()["files"][recorded]
    stat = cached.stat()
    key = (str(cached), stat.st_size, stat.st_mtime_ns)
    if _intact.get(key) != expected:
        if checksum(cached.read_bytes(), expected.partition(":")[0]) != expected:
            return False
        _intact[key] = expected
    return True


def _offline_copy(folder: Path, recorded: str, cached: Path) -> Path:
    """``recorded`` in the copy ``folder`` (of ``scripts/eval``, or of its ``local_data`` alone, whose task lists
    are then read from the ``yamls/`` beside it), else in the cache; never downloaded."""
    candidates = [folder / recorded]
    if recorded.startswith("local_data/"):  # a copy of the local_data folder alone
        candidates.append(folder / recorded.removeprefix("local_data/"))
    elif folder.name == "local_data":  # scripts/eval/local_data given: its task lists sit in scripts/eval/yamls
        candidates.append(folder.parent / recorded)
    for candidate in (*candidates, cached):
        if candidate.is_file():
            return candidate
    if recorded.startswith("yamls/"):
        name = recorded.removeprefix("yamls/")
        raise DataError(
            f"{ICL_DATA_ENV} (--icl-data) is {folder}, which has no task list {recorded} (looked for "
            f"{candidates[0]}). A copy of local_data/ holds the task files, not the lists that name them: pass a "
            f"copy of LLM Foundry's whole scripts/eval folder (local_data/ and yamls/, commit "
            f"{sources()['commit'][:12]}), or give the list's file itself (--tasks path/to/{name})."
        )
    raise DataError(
        f"{ICL_DATA_ENV} (--icl-data) is {folder}, which has no {recorded} (looked for {candidates[0]}). Point it "
        "at a copy of LLM Foundry's scripts/eval folder (or its local_data folder), or unset it to download the "
        "file."
    )


def source_url(recorded: str) -> str:
    mirror = os.environ.get(ICL_URL_ENV)
    if mirror:
        return f"{mirror.rstrip('/')}/{recorded}"
    return sources()["url"].format(commit=sources()["commit"], path=recorded)


def _download(recorded: str, destination: Path) -> None:
    """Fetch ``recorded``, check its checksum, then move it into ``destination`` (never a partial file)."""
    url = source_url(recorded)
    offline_hint = (
        f"On a machine without internet, copy LLM Foundry's scripts/eval folder (commit {sources()['commit'][:12]}) "
        f"there and pass --icl-data DIR (or set {ICL_DATA_ENV}=DIR)."
    )
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except urllib.error.HTTPError as error:
        raise DataError(
            f"Could not download {recorded} from {url}: HTTP {error.code} {error.reason}. {offline_hint}"
        ) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise DataError(f"Could not download {recorded} from {url} ({reason}). {offline_hint}") from None
    expected = sources()["files"][recorded]
    found = checksum(data, expected.partition(":")[0])
    if found != expected:
        raise DataError(
            f"{url} does not hold the recorded {recorded}: its checksum is {found}, icl_sources.json records "
            f"{expected}. The file was not kept. A mirror ({ICL_URL_ENV}) must serve the files of commit "
            f"{sources()['commit'][:12]}; otherwise report this (the file may have been altered in transit)."
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(f".{destination.name}.{secrets.token_hex(4)}.partial")
    partial.write_bytes(data)
    os.replace(partial, destination)  # atomic: ranks fetching the same file at once each publish a whole one


def checksum(data: bytes, algorithm: str) -> str:
    """``sha256:<hex>``, or ``git-blob-sha1:<hex>`` (the id git gives the bytes as a file of a commit)."""
    if algorithm == "git-blob-sha1":
        header = b"blob %d\0" % len(data)
        return f"{algorithm}:{hashlib.sha1(header + data).hexdigest()}"
    return f"sha256:{hashlib.sha256(data).hexdigest()}"
