"""Callbacks observe the run: they read ``State`` at events and log, save or stop; they never change training math."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from foundry.core.event import Event

if TYPE_CHECKING:
    from foundry.core.logger import Logger
    from foundry.core.state import State


class Callback:
    """Base class: override the method named after an event (``batch_end``, ``eval_end``, ...).

    Example::

        class PrintLoss(Callback):
            def batch_end(self, state, logger):
                if state.timestamp.batch % 10 == 0:
                    logger.log_metrics({"my/loss": state.loss.item()})

    Or override ``run_event`` to see every event.
    """

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        handler = getattr(self, event.value, None)
        if handler is not None:
            handler(state, logger)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to keep in checkpoints (e.g. a best metric so far)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def close(self) -> None:
        """Release resources (files, threads) when the run ends, even after an error."""


class LoggerDestination(Callback):
    """Where metrics go. A destination is also a callback, so it can react to events (flush at fit end)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        del metrics, step

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        del hyperparameters

    def log_text(self, text: str) -> None:
        """A human-readable line (warnings, summaries)."""
        del text
