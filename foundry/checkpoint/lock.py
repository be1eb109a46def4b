"""One live run per save_folder: rank 0 holds ``<save_folder>/.lock`` from the Trainer's start to fit's end.

Two live runs writing one folder would overwrite each other's checkpoints and prune each other's, and
with ``autoresume`` a second launch of the same command would pass every other check. The lock file is
created atomically (``O_CREAT | O_EXCL``) and names its holder: host, pid, the process's start time
and the run. A second run is refused at its start, naming the holder. A lock whose process is gone is
stale and is taken over with a warning naming it:

- on the same host, its pid no longer runs, or runs another process (a different start time);
- on another host (a shared filesystem), its heartbeat stopped: the holder touches the file every
  ``HEARTBEAT_S`` seconds, and a lock untouched for ``STALE_AFTER_S`` seconds is stale. A run that finds a
  recent lock of another host watches it for up to that long before it decides.

An object-store save_folder is locked in its local copy (``$FOUNDRY_CACHE_DIR/object_stores/...``): the
stores foundry writes through offer no create-if-absent, so runs on machines that do not share that
folder are not kept apart; give each run its own save_folder (``{run_name}`` in it) there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from foundry.distributed.env import all_gather_object
from foundry.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0
_POLL_S = 1.0


class SaveFolderLock:
    """The lock this process holds on a save_folder; ``release()`` (or the process's exit) gives it back."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="save-folder-lock", daemon=True)
        self._heartbeat.start()
        self._finalizer = weakref.finalize(self, _remove_own_lock, path, token, self._stop)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._finalizer()


def lock_save_folder(folder: Path, run_name: str, rank: int) -> SaveFolderLock | None:
    """Rank 0 takes the lock of ``folder`` (created if needed); every rank raises ``ConfigError`` if it is held.

    Every rank must call this. Returns the lock on rank 0, None on the others.
    """
    lock, problem = None, None
    if rank == 0:
        try:
            lock = acquire(Path(folder), run_name)
        except ConfigError as error:
            problem = str(error)
    problem = all_gather_object(problem)[0]
    if problem is not None:
        raise ConfigError(problem)
    return lock


def acquire(folder: Path, run_name: str) -> SaveFolderLock:
    """Take the lock of ``folder`` for this process, taking over a stale one; ``ConfigError`` if a live run holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    while True:
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            why_stale = stale_reason(holder, path)
            if why_stale is None:
                raise ConfigError(_held_message(folder, path, holder, run_name)) from None
            if holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
                log.warning("Taking over the lock of save_folder %s: %s (%s).", folder, why_stale, _describe(holder))
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        record = this_process(run_name)
        with os.fdopen(descriptor, "w") as file:
            json.dump(record, file)
        return SaveFolderLock(path, record["token"])


def this_process(run_name: str) -> dict[str, Any]:
    """What a lock records of its holder."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "run_name": run_name,
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "token": secrets.token_hex(8),  # which lock of this process it is: a later Trainer's takes over
    }


def stale_reason(holder: dict[str, Any], path: Path) -> str | None:
    """Why the lock at ``path`` held by ``holder`` is stale, or None while its process may be alive."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if pid == os.getpid():
            return "this process holds it (an earlier Trainer)"
        if not _pid_runs(pid):
            return f"process {pid} no longer runs"
        recorded = holder.get("process_start")
        if recorded is not None and _process_start(pid) not in (None, recorded):
            return f"process {pid} is another process now"
        return None
    return _heartbeat_stopped(path)


def _heartbeat_stopped(path: Path) -> str | None:
    """Watch the lock's heartbeat: None as soon as it beats, a reason once it has been still for STALE_AFTER_S."""
    try:
        last_beat = path.stat().st_mtime
    except FileNotFoundError:
        return "it was released"
    waited_s = max(0.0, time.time() - last_beat)  # the clocks of two hosts may differ: the watch below does not care
    deadline = time.monotonic() + STALE_AFTER_S - min(waited_s, STALE_AFTER_S)
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        try:
            if path.stat().st_mtime != last_beat:
                return None
        except FileNotFoundError:
            return "it was released"
    return f"its heartbeat stopped over {STALE_AFTER_S:.0f} s ago"


def _read_holder(path: Path) -> dict[str, Any]:
    """The lock's record; ``{}`` for an unreadable one (its writer died between creating and writing it)."""
    for _ in range(3):  # a lock being created is empty for an instant
        with contextlib.suppress(OSError, ValueError):
            holder = json.loads(path.read_text())
            if isinstance(holder, dict):
                return holder
        time.sleep(0.1)
    return {}


def _held_message(folder: Path, path: Path, holder: dict[str, Any], run_name: str) -> str:
    return (
        f"save_folder {folder} is in use by {_describe(holder)}, and this run is '{run_name}'. Two live runs would "
        f"overwrite and prune each other's checkpoints. Wait for that run to end (or stop it), or give this run "
        f"another save_folder (e.g. with {{run_name}} in it and a run_name of its own). If that process is gone, "
        f"its lock ({path}) is taken over once its heartbeat has stopped for {STALE_AFTER_S:.0f} s; delete the file "
        "only when you are sure no run writes the folder."
    )


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a run whose lock file is unreadable"
    return (
        f"run '{holder.get('run_name')}' (pid {holder.get('pid')} on host {holder.get('host')}, since "
        f"{holder.get('since')})"
    )


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), which tells a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _remove_own_lock(path: Path, token: str, stop: threading.Event) -> None:
    """Delete the lock if it is still the one with ``token`` and this process wrote it (not a forked data-loader
    worker exiting)."""
    stop.set()
    with contextlib.suppress(OSError, ValueError, AttributeError):
        holder = json.loads(path.read_text())
        if holder.get("token") == token and holder.get("pid") == os.getpid():
            path.unlink()
