"""Drive logger destinations by hand: a tiny State, a Logger, and a fake clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from foundry.core import Callback, Event, Logger, State, Time


@pytest.fixture
def state() -> State:
    return State(model=torch.nn.Linear(2, 2), max_duration=Time.parse("200ba"))


@pytest.fixture
def fire(state: State) -> Callable[[Callback, Event], None]:
    """Run one event on one destination, through a Logger that fans out to it alone."""

    def run(destination: Callback, event: Event) -> None:
        destination.run_event(event, state, Logger(state, []))

    return run


@pytest.fixture
def advance(state: State) -> Callable[[int], None]:
    """Move the timestamp forward by ``batches`` batches of 4 samples x 8 tokens."""

    def run(batches: int = 1) -> None:
        for _ in range(batches):
            state.timestamp = state.timestamp.after_batch(4, 32, duration_s=0.0)

    return run
