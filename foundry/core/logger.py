"""Metrics flow through one ``Logger`` to any number of ``LoggerDestination``s (console, jsonl, wandb, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from foundry.core.callback import Callback
from foundry.core.redact import scrub_secrets

if TYPE_CHECKING:
    from foundry.core.state import State


class LoggerDestination(Callback):
    """Where metrics go. A destination is also a callback, so it can react to events (flush at fit end)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        del metrics, step

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        del hyperparameters

    def log_text(self, text: str) -> None:
        """A human-readable line (warnings, summaries)."""
        del text


class Logger:
    """Fans metrics out to every destination; only rank 0 logs unless a destination opts in."""

    def __init__(self, state: State, destinations: Sequence[LoggerDestination] = ()) -> None:
        self._state = state
        self.destinations = list(destinations)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        step = self._state.timestamp.batch if step is None else step
        values = {key: _to_float(value) for key, value in metrics.items()}
        for destination in self.destinations:
            destination.log_metrics(values, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Send the run's config to every destination, secrets scrubbed (``foundry.core.redact``)."""
        hyperparameters = scrub_secrets(hyperparameters)
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)

    def log_text(self, text: str) -> None:
        for destination in self.destinations:
            destination.log_text(text)


def _to_float(value: Any) -> float:
    # ``.item()`` syncs the host with the device: call log_metrics only at logging intervals.
    return float(value.item()) if hasattr(value, "item") else float(value)
