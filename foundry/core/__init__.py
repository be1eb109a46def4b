"""The run's skeleton: time, events, state, and the engine that runs algorithms and callbacks."""

from __future__ import annotations

from foundry.lazy import lazy_exports

_EXPORTS = {
    "Algorithm": "foundry.core.algorithm",
    "Callback": "foundry.core.callback",
    "Engine": "foundry.core.engine",
    "Event": "foundry.core.event",
    "Interval": "foundry.core.interval",
    "Logger": "foundry.core.logger",
    "LoggerDestination": "foundry.core.callback",
    "State": "foundry.core.state",
    "Time": "foundry.core.time",
    "TimeUnit": "foundry.core.time",
    "Timestamp": "foundry.core.time",
    "seed_everything": "foundry.core.seed",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
