"""Runs algorithms then callbacks at each event, in a fixed, documented order.

Order at every event:
1. algorithms, in the order given (they may change ``State``);
2. callbacks, in the order given, then logger destinations (they observe the changed state).

At ``FIT_END`` and ``EVAL_END`` the same order holds; on shutdown ``close()`` runs on every
callback in reverse order, even after an exception, so files and threads are released.
"""

from __future__ import annotations

from collections.abc import Sequence

from foundry.core.algorithm import Algorithm
from foundry.core.callback import Callback
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State


class Engine:
    def __init__(
        self, state: State, logger: Logger, algorithms: Sequence[Algorithm] = (), callbacks: Sequence[Callback] = ()
    ) -> None:
        self.state = state
        self.logger = logger
        self.algorithms = list(algorithms)
        self.callbacks = list(callbacks) + list(logger.destinations)

    def run_event(self, event: Event) -> None:
        for algorithm in self.algorithms:
            if algorithm.match(event, self.state):
                algorithm.apply(event, self.state, self.logger)
        for callback in self.callbacks:
            callback.run_event(event, self.state, self.logger)

    def close(self) -> None:
        errors = []
        for callback in reversed(self.callbacks):
            try:
                callback.close()
            except Exception as error:  # keep closing the others; report the first failure
                errors.append(error)
        if errors:
            raise errors[0]
