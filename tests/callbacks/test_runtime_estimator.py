"""RuntimeEstimator: remaining fraction x observed train seconds per fraction, eval left out."""

from __future__ import annotations

import pytest

from foundry import registry
from foundry.callbacks import RuntimeEstimator
from foundry.core import Event
from foundry.errors import ConfigError
from foundry.schema import check_call_kwargs


def test_estimate_extrapolates_the_rate_after_skipped_batches(recorder, clock, fire, train_batch):
    estimator = RuntimeEstimator(skip_batches=1, time_unit="seconds", clock=clock)
    fire(estimator, Event.FIT_START)
    clock.now = 50.0  # the first batch compiles: slow, and skipped
    train_batch(estimator)
    assert recorder.last("time/remaining_estimate") is None
    clock.now = 52.0
    train_batch(estimator)
    # 2 s per batch (0.1 of the run) after the skipped one; 8 of 10 batches left.
    assert recorder.last("time/remaining_estimate") == pytest.approx(16.0)


def test_eval_time_does_not_slow_the_estimate(recorder, clock, fire, train_batch):
    estimator = RuntimeEstimator(skip_batches=0, time_unit="seconds", clock=clock)
    fire(estimator, Event.FIT_START)
    clock.now = 1.0
    train_batch(estimator)
    fire(estimator, Event.EVAL_START)
    clock.now = 100.0
    fire(estimator, Event.EVAL_END)
    clock.now = 101.0
    train_batch(estimator)
    assert recorder.last("time/remaining_estimate") == pytest.approx(8.0)


def test_estimate_is_in_hours_by_default(recorder, clock, fire, train_batch):
    estimator = RuntimeEstimator(skip_batches=0, clock=clock)
    fire(estimator, Event.FIT_START)
    clock.now = 360.0
    train_batch(estimator)
    assert recorder.last("time/remaining_estimate") == pytest.approx(0.9)  # 9 batches x 360 s
    assert recorder.hyperparameters == {"time/remaining_estimate_unit": "hours"}


def test_unknown_time_unit_is_a_config_error():
    with pytest.raises(ConfigError, match="time_unit"):
        check_call_kwargs(registry.callbacks.get("runtime_estimator"), {"time_unit": "weeks"}, "callbacks.runtime")
