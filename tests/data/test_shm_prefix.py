"""The shared-memory prefix election: jobs that start together take different prefixes, a rank attaches only to its
own leader's segment, a killed job's leftovers are skipped, and streaming's local-folder rule holds for running jobs
only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import repo_pythonpath
from streaming.base.constant import BARRIER_FILELOCK, LOCALS, NEXT_EPOCH
from streaming.base.shared import SharedMemory
from streaming.base.shared.prefix import _get_path, _unpack_locals

from foundry.data import shm_prefix
from foundry.data.shm_prefix import elect_shm_prefix, elected_shm_prefixes
from foundry.errors import DataError

LEADER = SimpleNamespace(is_local_leader=True, rank=0, rank_of_node=0)
SECOND_RANK = SimpleNamespace(is_local_leader=False, rank=1, rank_of_node=1)


@pytest.fixture
def elect() -> Iterator[Callable[..., tuple[int, Any]]]:
    """``elect_shm_prefix`` whose segments are freed, and prefixes given up, when the test ends."""
    elected = []

    def run(*args: Any) -> tuple[int, Any]:
        prefix, segment = elect_shm_prefix(*args)
        elected.append((prefix, segment))
        return prefix, segment

    yield run
    for prefix, segment in elected:
        segment.cleanup()
        shm_prefix.release_ownership(prefix)


def first_free_prefix() -> int:
    prefix = 0
    while shm_prefix._in_use(prefix):
        prefix += 1
    return prefix


def test_jobs_that_elect_at_once_take_different_prefixes(elect, tmp_path: Path) -> None:
    jobs = 4
    barrier, prefixes, errors = threading.Barrier(jobs), [], []

    def leader_of_job(index: int) -> None:
        barrier.wait()  # every job's leader scans at the same instant, as runs launched together do
        try:
            prefixes.append(elect([str(tmp_path / f"job{index}")], [None], LEADER)[0])
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=leader_of_job, args=(index,)) for index in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(prefixes)) == jobs


def test_a_second_rank_attaches_to_its_own_leaders_segment(elect, tmp_path: Path, monkeypatch) -> None:
    other_job, _ = elect([str(tmp_path / "other")], [None], LEADER)
    ours, _ = elect([str(tmp_path / "ours")], [None], LEADER)
    monkeypatch.setattr(shm_prefix, "all_gather_object", lambda value: [(ours, None), value])
    prefix, segment = elect([str(tmp_path / "ours")], [None], SECOND_RANK)
    assert prefix == ours != other_job
    assert _unpack_locals(bytes(segment.buf)) == ([str(tmp_path / "ours")], ours)
    with pytest.raises(DataError, match="Every rank must build the same dataset"):
        elect([str(tmp_path / "elsewhere")], [None], SECOND_RANK)


def test_a_killed_jobs_segment_and_lock_file_are_skipped(elect, tmp_path: Path) -> None:
    stale_segment = first_free_prefix()
    left_behind = SharedMemory(_get_path(stale_segment, NEXT_EPOCH), True, 8, auto_cleanup=False)
    stale_lock_file = first_free_prefix()
    stale_lock = Path(tempfile.gettempdir()) / _get_path(stale_lock_file, BARRIER_FILELOCK)
    stale_lock.touch()
    try:
        prefix, _ = elect([str(tmp_path)], [None], LEADER)
    finally:
        left_behind.cleanup()
        stale_lock.unlink()
    assert prefix not in (stale_segment, stale_lock_file)


def test_two_datasets_downloading_into_one_local_folder_fail_on_every_rank(elect, tmp_path: Path) -> None:
    elect([str(tmp_path)], ["s3://bucket/data"], LEADER)
    with pytest.raises(DataError, match=f"local folder {tmp_path} is in use by another running dataset"):
        elect([str(tmp_path)], ["s3://bucket/data"], LEADER)
    elect([str(tmp_path)], [None], LEADER)  # reading a folder in place shares it


KILLED_JOB = """
import os, signal, sys
from multiprocessing import resource_tracker
from types import SimpleNamespace
from foundry.data.shm_prefix import elect_shm_prefix

prefix, _ = elect_shm_prefix([sys.argv[1]], ["s3://bucket/data"], SimpleNamespace(is_local_leader=True))
print(prefix, flush=True)
# Killed with its whole process group, as a scheduler kills a job: Python's resource tracker cannot free the memory.
os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_a_killed_job_does_not_keep_its_relaunch_from_its_local_folder(elect, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    killed = subprocess.run([sys.executable, "-c", KILLED_JOB, str(tmp_path)], capture_output=True, text=True, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left_behind = int(killed.stdout)
    try:
        prefix, _ = elect([str(tmp_path)], ["s3://bucket/data"], LEADER)
    finally:
        (Path("/dev/shm") / _get_path(left_behind, LOCALS)).unlink()
        shm_prefix._owner_file(left_behind).unlink()
    assert prefix != left_behind


def test_streaming_is_given_its_function_back(monkeypatch) -> None:
    import streaming.base.dataset as streaming_dataset

    original = streaming_dataset.get_shm_prefix
    with elected_shm_prefixes():
        assert streaming_dataset.get_shm_prefix is elect_shm_prefix
    assert streaming_dataset.get_shm_prefix is original
    monkeypatch.setattr(streaming_dataset, "get_shm_prefix", lambda streams_local, world: None)
    with pytest.raises(DataError, match="mosaicml-streaming==0.13"), elected_shm_prefixes():
        pass
