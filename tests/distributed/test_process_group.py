"""The process group's start and first collective name their stage and who did not come, within the start timeout
(not ``dist_timeout``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import RendezvousStore, repo_pythonpath

from foundry.distributed import get_rank
from foundry.distributed.process_group import meet_every_rank
from foundry.errors import TrainingError


def meet(late_rank: int, late_s: float, timeout_s: float) -> str | None:
    """``meet_every_rank`` after ``late_s`` on ``late_rank``: its error, or None."""
    if get_rank() == late_rank:
        time.sleep(late_s)  # a rank that hangs before the first collective (slow storage, a deadlock)
    try:
        meet_every_rank(timeout_s)
    except TrainingError as error:
        return str(error)
    return None


def test_ranks_that_all_come_pass(ranks):
    assert ranks.run(2, meet, 1, 0.0, 30.0) == [None, None]


@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_a_rank_that_does_not_come_is_named_by_rank_0_within_the_timeout(ranks):
    started = time.monotonic()
    rank0, _ = ranks.run(2, meet, 1, 6.0, 2.0)
    assert rank0 is not None and rank0.startswith("first collective: rank(s) 1 of 2 did not arrive within 2 s"), rank0
    assert time.monotonic() - started < 30


JOIN_ALONE = "from foundry.distributed import init_process_group\ninit_process_group(timeout_s=600)"


@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_a_process_group_whose_other_rank_never_starts_fails_within_the_start_timeout_naming_the_stage():
    """Rank 0 of 2 alone: gloo waits for rank 1's address in the store, for the start timeout (not dist_timeout)."""
    rendezvous = RendezvousStore()
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), **rendezvous.env, "CUDA_VISIBLE_DEVICES": ""}
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", FOUNDRY_START_TIMEOUT_S="3")
    started = time.monotonic()
    alone = subprocess.run([sys.executable, "-c", JOIN_ALONE], env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode != 0
    assert "TrainingError: process-group start: rank 0 of 2 could not connect to every other rank through the " \
           f"store at 127.0.0.1:{rendezvous.store.port} within 3 s" in alone.stderr, alone.stderr[-3000:]  # fmt: skip
    assert time.monotonic() - started < 60
