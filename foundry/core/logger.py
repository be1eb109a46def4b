"""Metrics flow through one ``Logger`` to any number of ``LoggerDestination``s (console, jsonl, wandb, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from foundry.core.redact import scrub_secrets

if TYPE_CHECKING:
    from foundry.core.state import State


class MetricsDestination(Protocol):
    """What the Logger sends to: ``foundry.core.callback.LoggerDestination`` and its subclasses."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None: ...

    def log_text(self, text: str) -> None: ...


class Logger:
    """Fans metrics out to every destination; only rank 0 logs unless a destination opts in.

    Destinations receive floats. A value that is a tensor on an accelerator would need a host sync to
    become one, so such a call waits in a queue, still on the device, with every call after it (order
    is kept: W&B drops steps that go backwards), until ``flush()`` converts all queued values at once:
    one sync for many batches. The Trainer flushes at ``console_log_interval``, around evaluation and
    at the end of fit; a long queue flushes itself.
    """

    MAX_QUEUED_CALLS = 256  # bounds the device tensors kept alive between flushes

    def __init__(self, state: State, destinations: Sequence[MetricsDestination] = ()) -> None:
        self._state = state
        self.destinations = list(destinations)
        self._queue: list[tuple[dict[str, Any], int]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        step = self._state.timestamp.batch if step is None else step
        if self._queue or any(_on_accelerator(value) for value in metrics.values()):
            self._queue.append((dict(metrics), step))
            if len(self._queue) >= self.MAX_QUEUED_CALLS:
                self.flush()
            return
        self._send({key: _to_float(value) for key, value in metrics.items()}, step)

    def flush(self) -> None:
        """Send every queued call to the destinations, in order, after one conversion of their tensors."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        tensors = [value for metrics, _ in queue for value in metrics.values() if _on_accelerator(value)]
        floats = iter(_tensors_to_floats(tensors))
        for metrics, step in queue:
            self._send({k: next(floats) if _on_accelerator(v) else _to_float(v) for k, v in metrics.items()}, step)

    def _send(self, values: dict[str, float], step: int) -> None:
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


def _on_accelerator(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _tensors_to_floats(tensors: list[torch.Tensor]) -> list[float]:
    """Scalar tensors (any devices) as floats, with one device-to-host copy per device."""
    floats: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    for indices in by_device.values():
        stacked = torch.stack([tensors[i].detach().reshape(()).double() for i in indices]).tolist()
        for index, value in zip(indices, stacked):
            floats[index] = value
    return floats


def _to_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)
