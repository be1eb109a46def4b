"""The process group's first collective names the ranks that did not come, within the start timeout."""

from __future__ import annotations

import time

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


def test_a_rank_that_does_not_come_is_named_by_rank_0_within_the_timeout(ranks):
    started = time.monotonic()
    rank0, _ = ranks.run(2, meet, 1, 6.0, 2.0)
    assert rank0 is not None and rank0.startswith("first collective: rank(s) 1 of 2 did not arrive within 2 s"), rank0
    assert time.monotonic() - started < 30
