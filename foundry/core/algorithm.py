"""Algorithms change the run: swap modules, fuse kernels, clip gradients. Two methods: ``match`` and ``apply``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from foundry.core.event import Event
    from foundry.core.logger import Logger
    from foundry.core.state import State


class Algorithm:
    """Base class for anything that modifies training.

    Example::

        class ScaleLoss(Algorithm):
            def match(self, event, state):
                return event == Event.AFTER_LOSS

            def apply(self, event, state, logger):
                state.loss = state.loss * 0.5
    """

    def match(self, event: Event, state: State) -> bool:
        """Whether ``apply`` should run at this event."""
        raise NotImplementedError

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        """Change ``state``; the return value is ignored."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
