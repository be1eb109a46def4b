"""foundry: fast, portable LLM training and evaluation on PyTorch."""

from foundry.core import Algorithm, Callback, Event, Logger, LoggerDestination, State, Time, Timestamp
from foundry.errors import CheckpointError, ConfigError, DataError, FoundryError, TrainingError
from foundry.models.base import CausalLM, FoundryModel

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "Callback",
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "Event",
    "FoundryError",
    "FoundryModel",
    "Logger",
    "LoggerDestination",
    "State",
    "Time",
    "Timestamp",
    "TrainingError",
    "__version__",
]
