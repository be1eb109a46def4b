"""A cadence of the run ("500ba", "1ep", "0.25dur", ...) and whether the last step crossed one of its multiples.

The loop, callbacks and loggers that act every so often (eval, checkpoints, console lines, hand-over)
all ask the same question the same way: an epoch cadence is answered at epoch ends, every other unit
after each batch, and a step that moves the run past a multiple of the cadence makes it due.
"""

from __future__ import annotations

from foundry.core.state import State
from foundry.core.time import Time, Timestamp, TimeUnit


class Interval:
    """Every ``every`` of the run; ``mark`` the timestamp before a step, then ask ``due`` after it.

    Example (a callback)::

        self.interval = Interval("500ba")
        def batch_start(self, state, logger): self.interval.mark(state)
        def batch_end(self, state, logger):
            if self.interval.due(state): ...
    """

    def __init__(self, every: str | int | Time) -> None:
        self.every = Time.parse(every)
        self._before: Timestamp | None = None

    def mark(self, state: State) -> None:
        """Remember where the run is, before the step that ``due`` will be asked about."""
        self._before = state.timestamp

    def due(self, state: State, epoch_end: bool = False, since: Timestamp | None = None) -> bool:
        """Whether the run crossed a multiple since ``since`` (default: the last ``mark``).

        Args:
            epoch_end: asked at an epoch end (answers epoch cadences) or after a batch (all others).
        """
        before = since if since is not None else self._before
        if before is None:
            return False
        is_epoch_cadence = state.to_absolute(self.every).unit == TimeUnit.EPOCH
        return is_epoch_cadence == epoch_end and state.crossed_multiple(self.every, before)
