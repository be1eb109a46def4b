"""Built-in logger destinations; importing this package registers them under their YAML names."""

from foundry.loggers.console import ConsoleLogger
from foundry.loggers.jsonl import JSONLLogger

__all__ = ["ConsoleLogger", "JSONLLogger"]
