"""Interval: one answer to "is this cadence due" for the loop, callbacks and loggers."""

from __future__ import annotations

from helpers import TinyLM

from foundry.core import Interval, State, Time


def _state(max_duration: str = "10ba", batches_per_epoch: int = 4) -> State:
    return State(model=TinyLM(), max_duration=Time.parse(max_duration), train_dataloader_len=batches_per_epoch)


def _batch(state: State) -> None:
    state.timestamp = state.timestamp.after_batch(2, 16, 0.1)


def test_a_batch_cadence_is_due_after_each_multiple_of_batches() -> None:
    state, interval, due = _state(), Interval("3ba"), []
    for _ in range(7):
        interval.mark(state)
        _batch(state)
        due.append(interval.due(state))
    assert due == [False, False, True, False, False, True, False]


def test_an_epoch_cadence_is_due_at_epoch_ends_only() -> None:
    state, interval = _state(), Interval("1ep")
    for _ in range(4):
        interval.mark(state)
        _batch(state)
        assert not interval.due(state)
    before = state.timestamp
    state.timestamp = state.timestamp.after_epoch()
    assert interval.due(state, epoch_end=True, since=before)


def test_a_fraction_of_the_run_is_counted_in_its_unit() -> None:
    state, interval, due = _state("8ba"), Interval("0.25dur"), []
    for _ in range(8):
        interval.mark(state)
        _batch(state)
        due.append(interval.due(state))
    assert due == [False, True] * 4


def test_token_and_sample_cadences_fire_when_a_batch_crosses_a_multiple() -> None:
    state, tokens, samples = _state(), Interval("40tok"), Interval("4sp")
    fired = []
    for _ in range(5):  # 16 tokens and 2 samples a batch
        tokens.mark(state), samples.mark(state)
        _batch(state)
        fired.append((tokens.due(state), samples.due(state)))
    assert fired == [(False, False), (False, True), (True, False), (False, True), (True, False)]


def test_nothing_is_due_before_a_mark() -> None:
    state = _state()
    _batch(state)
    assert not Interval("1ba").due(state)
