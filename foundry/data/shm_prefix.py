"""Which shared-memory prefix a StreamingDataset takes: elected per job by foundry, so jobs on one host keep apart.

mosaicml-streaming names a dataset's shared memory ``{prefix:06}_locals``, ``{prefix:06}_barrier``, ... and picks
the prefix in ``get_shm_prefix``: every rank scans for the first free one on its own, the node's first rank creates
``{prefix}_locals`` between two barriers over the whole job, and the other ranks attach to whatever holds that name.
Nothing in the name says which job it belongs to, so two jobs that start together on one host take the same prefix
(the second leader dies with ``FileExistsError``) or a rank attaches to the other job's segment (``shared memory
registered does not match local leader``). A host-wide lock held across those barriers does not help: two launchers
that make one job (``--nnodes 2`` on one host) deadlock, one leader in the barrier, the other waiting for the lock.

Here the local leader of each node elects the prefix alone. Under a host-wide lock held for the scan and one
atomic create only (never across a collective), it takes the first prefix of which no segment and no lock file
exists, so a stale one from a killed job is skipped, and creates ``{prefix}_locals`` (O_EXCL). The job's ranks then
learn their own leader's prefix through the job's process group (one ``all_gather_object``), so a rank can attach
only to its own leader's segment; a leader's failure reaches every rank instead of leaving them in a collective.
Streaming refuses a second running dataset that downloads into the same local folder; a leader holds a lock on an
owner file of its prefix while it lives, so a killed job's segments, whose lock the kernel dropped, do not count
as running and its relaunch is not refused.

The election lock and the owner files sit in /dev/shm, which every job on the host sees whatever its TMPDIR.
``elected_shm_prefixes()`` swaps ``elect_shm_prefix`` in for streaming's function while foundry builds a dataset.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import inspect
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from tempfile import gettempdir
from typing import Any

from filelock import FileLock

from foundry.distributed.env import all_gather_object
from foundry.errors import DataError

_SHM_FOLDER = Path("/dev/shm")  # POSIX shared memory on Linux, the same folder for every job on the host
ELECTION_LOCK = (_SHM_FOLDER if _SHM_FOLDER.is_dir() else Path("/tmp")) / "foundry-streaming-prefix.lock"
_STREAMING_SIGNATURE = ["streams_local", "streams_remote", "world", "retry"]


@contextlib.contextmanager
def elected_shm_prefixes() -> Iterator[None]:
    """While inside, a StreamingDataset built in this process takes its prefix from ``elect_shm_prefix``."""
    import streaming.base.dataset as streaming_dataset

    original = getattr(streaming_dataset, "get_shm_prefix", None)
    if original is None or list(inspect.signature(original).parameters) != _STREAMING_SIGNATURE:
        from streaming import __version__

        raise DataError(
            f"mosaicml-streaming {__version__} no longer picks shared-memory names through "
            f"streaming.base.dataset.get_shm_prefix({', '.join(_STREAMING_SIGNATURE)}), which foundry replaces "
            "so that jobs on one host keep apart. Install the version foundry is tested with: "
            "pip install 'mosaicml-streaming==0.13.*'"
        )
    streaming_dataset.get_shm_prefix = elect_shm_prefix
    try:
        yield
    finally:
        streaming_dataset.get_shm_prefix = original


def elect_shm_prefix(
    streams_local: list[str], streams_remote: list[str | None], world: Any, retry: int = 100
) -> tuple[int, Any]:
    """Streaming's ``get_shm_prefix``, elected per node by its leader: ``(prefix, the {prefix}_locals segment)``.

    Every rank of the job calls it at once (it is a collective when the process group is up).
    """
    del retry  # streaming retries its scan against a racing destructor; the election lock makes it unneeded
    from streaming.base.shared.prefix import _check_self

    _check_self(streams_local)
    prefix, failure, segment = None, None, None
    if world.is_local_leader:
        try:
            prefix, segment = _register(streams_local, streams_remote)
        except (ValueError, OSError) as error:
            failure = f"{type(error).__name__}: {error}"
    elected = all_gather_object((prefix, failure))  # [(prefix, failure)] in one process
    failures = [f"rank {rank}: {failure}" for rank, (_, failure) in enumerate(elected) if failure]
    if failures:
        if segment is not None:
            segment.cleanup()
            release_ownership(prefix)
        raise DataError(
            "The first rank of a machine could not register the dataset's shared memory, "
            f"so no rank can read it ({'; '.join(failures)}). Give each running job its own 'local' folder. If no "
            "other job uses that folder, a dataset built outside foundry left its memory behind: run python -c "
            "'import streaming; streaming.base.util.clean_stale_shared_memory()' once, when no job runs."
        )
    if world.is_local_leader:
        return prefix, segment
    leader_prefix, _ = elected[world.rank - world.rank_of_node]
    return leader_prefix, _attach(leader_prefix, streams_local)


def _register(streams_local: list[str], streams_remote: list[str | None]) -> tuple[int, Any]:
    """Take the first prefix nothing uses and create its ``locals`` segment, holding the election lock briefly."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _get_path, _pack_locals

    with FileLock(ELECTION_LOCK, mode=0o666):
        for prefix in itertools.count():
            if _in_use(prefix):
                _check_local_folders(prefix, streams_local, streams_remote)
                continue
            data = _pack_locals(streams_local, prefix)
            try:
                segment = SharedMemory(_get_path(prefix, LOCALS), True, len(data))
            except FileExistsError:  # a process outside foundry's election took it since the scan
                continue
            segment.buf[: len(data)] = data
            try:
                _hold_ownership(prefix)
            except OSError:
                segment.cleanup()
                raise
            return prefix, segment


def _in_use(prefix: int) -> bool:
    """Whether any segment or lock file of ``prefix`` exists (a running dataset's, or a killed job's left behind)."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, SHM_TO_CLEAN
    from streaming.base.shared.prefix import _get_path

    lock_files = (Path(gettempdir()) / _get_path(prefix, name) for name in (BARRIER_FILELOCK, CACHE_FILELOCK))
    return any(path.exists() for path in lock_files) or any(
        _segment_exists(_get_path(prefix, name)) for name in SHM_TO_CLEAN
    )


def _segment_exists(name: str) -> bool:
    from streaming.base.shared import SharedMemory

    if _SHM_FOLDER.is_dir():
        return (_SHM_FOLDER / name).exists()
    try:
        SharedMemory(name, False, auto_cleanup=False).cleanup()
    except FileNotFoundError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _check_local_folders(prefix: int, streams_local: list[str], streams_remote: list[str | None]) -> None:
    """Streaming's rule: two running datasets may not download into one local folder (streams with a remote)."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    downloaded = {local for local, remote in zip(streams_local, streams_remote, strict=True) if remote is not None}
    if not downloaded:
        return
    try:
        segment = SharedMemory(_get_path(prefix, LOCALS), False, auto_cleanup=False)
    except (FileNotFoundError, PermissionError):
        return
    try:
        their_locals, _ = _unpack_locals(bytes(segment.buf))
    finally:
        segment.cleanup()
    if (reused := sorted(downloaded.intersection(their_locals))) and not _abandoned(prefix):
        raise ValueError(
            f"local folder {', '.join(reused)} is in use by another running dataset (shared-memory prefix {prefix}), "
            "and both download into it from a remote"
        )


def _attach(prefix: int, streams_local: list[str]) -> Any:
    """This node's leader's ``locals`` segment, checked to hold this rank's own folders."""
    from streaming.base.constant import LOCALS
    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    segment = SharedMemory(_get_path(prefix, LOCALS), False)
    their_locals, their_prefix = _unpack_locals(bytes(segment.buf))
    if their_locals != streams_local or their_prefix != prefix:
        segment.cleanup()
        raise DataError(
            f"This machine's first rank registered the dataset folders {their_locals} (prefix {their_prefix}), but "
            f"this rank reads {streams_local} (prefix {prefix}). Every rank must build the same dataset: give all "
            "ranks the same 'local', 'remote' and 'split' settings."
        )
    return segment


# A leader holds a shared flock on its prefix's owner file while its dataset lives; the kernel drops it when the
# process dies however it dies, so a prefix whose owner file can be locked exclusively was left by a killed job.
_owner_files: dict[int, int] = {}  # prefix -> open descriptor of its owner file, in this process


def _owner_file(prefix: int) -> Path:
    return ELECTION_LOCK.parent / f"foundry-streaming-{prefix:06}.owner"


def _hold_ownership(prefix: int) -> None:
    descriptor = os.open(_owner_file(prefix), os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    _owner_files[prefix] = descriptor
    atexit.register(release_ownership, prefix)  # as streaming frees the segments at exit: no file left behind


def release_ownership(prefix: int) -> None:
    """Give up ``prefix`` (its dataset's shared memory is freed): its owner file goes."""
    descriptor = _owner_files.pop(prefix, None)
    if descriptor is not None:
        with contextlib.suppress(FileNotFoundError):
            _owner_file(prefix).unlink()
        os.close(descriptor)


def _abandoned(prefix: int) -> bool:
    """Whether ``prefix`` was registered by a foundry process that is gone (no file: not foundry's, so alive)."""
    try:
        descriptor = os.open(_owner_file(prefix), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)
    return True


def release_shared_memory(dataset: Any) -> None:
    """Free a StreamingDataset's shared-memory blocks, temp-folder lock files and foundry's claim on its prefix.

    Streaming frees them only at process exit; this reaches into its private attributes, each
    looked up defensively so that a streaming version without one skips it.
    """
    holders = [
        getattr(dataset, "_locals_shm", None),
        getattr(getattr(getattr(dataset, "_shared_barrier", None), "_arr", None), "shm", None),
        *(getattr(getattr(getattr(dataset, name, None), "arr", None), "shm", None) for name in _SCALARS),
        *(getattr(getattr(dataset, name, None), "shm", None) for name in _ARRAYS),
        getattr(dataset, "_resume_shm", None),
    ]
    for shared_memory in filter(None, holders):
        shared_memory.cleanup()
        atexit.unregister(shared_memory.cleanup)
    barrier_lock = getattr(getattr(dataset, "_shared_barrier", None), "filelock_path", None)
    for path in (getattr(dataset, "_cache_filelock_path", None), barrier_lock):
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    if (prefix := getattr(dataset, "_shm_prefix_int", None)) is not None:
        release_ownership(prefix)


_SCALARS = ("_next_epoch", "_cache_usage")
_ARRAYS = ("_shard_states", "_shard_access_times")
