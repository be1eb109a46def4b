"""Hand the run over: at each interval, checkpoint and stop, so that a scheduler can continue it elsewhere.

A job that may only hold its machines for a while (a preemptible queue, a time slot on another
vendor's GPUs) trains one interval, hands over, and is relaunched, on any number of ranks::

    callbacks:
      hand_over:
        interval: 1000ba
    autoresume: true          # the relaunch continues from the hand-over checkpoint
    save_folder: /shared/runs/{run_name}/checkpoints

``foundry train`` then prints ``handed over at batch N`` and exits with ``HANDED_OVER_EXIT_CODE``
(3); the run's last batch never hands over, so a finished run exits 0. See docs/DISTRIBUTED.md.
"""

from __future__ import annotations

from pathlib import Path

from foundry import registry
from foundry.checkpoint.layout import checkpoint_name
from foundry.core.callback import Callback
from foundry.core.interval import Interval
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import EXIT_HANDED_OVER, TrainingError

HANDED_OVER_EXIT_CODE = EXIT_HANDED_OVER


@registry.callbacks.register("hand_over")
class HandOver(Callback):
    """Stop the run after each ``interval``; the Trainer's end-of-fit save writes the checkpoint.

    Args:
        interval: how much training each launch does: ``"1000ba"``, ``"1ep"``, ``"0.25dur"``...
    """

    def __init__(self, interval: str | int | Time) -> None:
        self.interval = Interval(interval)
        self.handed_over_at: int | None = None  # the batch this launch handed over at

    def batch_start(self, state: State, logger: Logger) -> None:
        self.interval.mark(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state):
            self._stop(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state, epoch_end=True):
            self._stop(state, logger)

    def _stop(self, state: State, logger: Logger) -> None:
        if state.reached(state.max_duration):  # the run is done: nothing to hand over
            return
        self.handed_over_at = state.timestamp.batch
        state.stop_reason = f"handed over at batch {self.handed_over_at}"
        logger.log_text(f"Handing over at batch {self.handed_over_at}: checkpointing and stopping.")

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.handed_over_at is None:
            return
        saved = state.last_checkpoint_path
        if saved is None or Path(saved).name != checkpoint_name(state.timestamp):
            raise TrainingError(
                f"hand_over stopped the run at batch {self.handed_over_at} but no checkpoint was written there, "
                "so a relaunch could not continue. Set save_folder (and autoresume: true to continue)."
            )


def handed_over(callbacks: list[Callback]) -> bool:
    """Whether a ``HandOver`` among ``callbacks`` stopped this launch."""
    return any(isinstance(callback, HandOver) and callback.handed_over_at is not None for callback in callbacks)
