"""The run's skeleton: time, events, state, and the engine that runs algorithms and callbacks."""

from foundry.core.algorithm import Algorithm
from foundry.core.callback import Callback
from foundry.core.engine import Engine
from foundry.core.event import Event
from foundry.core.interval import Interval
from foundry.core.logger import Logger, LoggerDestination
from foundry.core.seed import seed_everything
from foundry.core.state import State
from foundry.core.time import Time, Timestamp, TimeUnit

__all__ = [
    "Algorithm",
    "Callback",
    "Engine",
    "Event",
    "Interval",
    "Logger",
    "LoggerDestination",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "seed_everything",
]
