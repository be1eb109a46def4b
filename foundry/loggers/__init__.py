"""Built-in logger destinations; importing this package registers them under their YAML names.

``wandb`` and ``tensorboard`` import their client packages only when built, so this import stays light.
"""

from foundry.loggers.console import ConsoleLogger
from foundry.loggers.defaults import default_loggers
from foundry.loggers.jsonl import JSONLLogger
from foundry.loggers.tensorboard import TensorboardLogger
from foundry.loggers.wandb import WandBLogger

__all__ = ["ConsoleLogger", "JSONLLogger", "TensorboardLogger", "WandBLogger", "default_loggers"]
