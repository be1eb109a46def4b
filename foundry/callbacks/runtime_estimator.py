"""How long training has left: observed train seconds per fraction of ``max_duration``, extrapolated."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from foundry import registry
from foundry.callbacks.speed_monitor import TrainClock
from foundry.core.callback import Callback
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import SECONDS_PER_UNIT
from foundry.errors import ConfigError

TimeUnitName = Literal["seconds", "minutes", "hours", "days"]


@registry.callbacks.register("runtime_estimator")
class RuntimeEstimator(Callback):
    """Logs ``time/remaining_estimate`` (in ``time_unit``) at every BATCH_END once it has a rate.

    The rate is measured from the end of batch ``skip_batches`` of this ``fit`` (early batches pay for
    compilation and warm caches) and counts training only: eval and checkpoint time are left out
    of the rate and of the estimate. The unit is also logged once as the hyperparameter
    ``time/remaining_estimate_unit``.

    Args:
        skip_batches: Batches to leave out of the rate at the start of each ``fit``.
        time_unit: 'seconds', 'minutes', 'hours' or 'days'.
        clock: Seconds from an arbitrary origin; injectable for tests.
    """

    def __init__(
        self, skip_batches: int = 1, time_unit: TimeUnitName = "hours", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if time_unit not in SECONDS_PER_UNIT:
            raise ConfigError(
                f"callbacks.runtime_estimator.time_unit is {time_unit!r}; use one of {', '.join(SECONDS_PER_UNIT)}."
            )
        if skip_batches < 0:
            raise ConfigError(f"callbacks.runtime_estimator.skip_batches is {skip_batches}; it must be >= 0.")
        self.skip_batches = skip_batches
        self.time_unit = time_unit
        self.train_clock = TrainClock(clock)
        self._batches_this_fit = 0
        self._start: tuple[float, float] | None = None  # (train seconds, progress) where the rate starts

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self.train_clock.observe(event)
        super().run_event(event, state, logger)

    def fit_start(self, state: State, logger: Logger) -> None:
        logger.log_hyperparameters({"time/remaining_estimate_unit": self.time_unit})
        self._batches_this_fit = 0
        self._start = (self.train_clock.train_s, state.progress) if self.skip_batches == 0 else None

    def batch_end(self, state: State, logger: Logger) -> None:
        self._batches_this_fit += 1
        train_s, progress = self.train_clock.train_s, state.progress
        if self._batches_this_fit == self.skip_batches:
            self._start = (train_s, progress)
            return
        if self._start is None:
            return
        start_s, start_progress = self._start
        if progress <= start_progress:  # e.g. an epoch-long run whose loader length is unknown
            return
        seconds_per_progress = (train_s - start_s) / (progress - start_progress)
        remaining_s = seconds_per_progress * (1.0 - progress)
        logger.log_metrics({"time/remaining_estimate": remaining_s / SECONDS_PER_UNIT[self.time_unit]})
