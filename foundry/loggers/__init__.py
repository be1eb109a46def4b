"""Built-in logger destinations, registered under their YAML names when ``foundry.registry.loggers`` loads them.

Names load on first use (``foundry.lazy``); ``wandb`` and ``tensorboard`` import their client packages only when built.
"""

from __future__ import annotations

from foundry.lazy import lazy_exports

_EXPORTS = {
    "ConsoleLogger": "foundry.loggers.console",
    "JSONLLogger": "foundry.loggers.jsonl",
    "TensorboardLogger": "foundry.loggers.tensorboard",
    "WandBLogger": "foundry.loggers.wandb",
    "default_loggers": "foundry.loggers.defaults",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
