"""foundry: fast, portable LLM training and evaluation on PyTorch.

Names load on first use, so ``foundry --help`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Algorithm": "foundry.core",
    "Callback": "foundry.core",
    "Event": "foundry.core",
    "Logger": "foundry.core",
    "LoggerDestination": "foundry.core",
    "State": "foundry.core",
    "Time": "foundry.core",
    "Timestamp": "foundry.core",
    "CausalLM": "foundry.models.base",
    "FoundryModel": "foundry.models.base",
    "CheckpointConfig": "foundry.checkpoint.config",
    "CheckpointError": "foundry.errors",
    "ConsoleConfig": "foundry.loggers.config",
    "EvalConfig": "foundry.eval.config",
    "FSDPConfig": "foundry.distributed.config",
    "ParallelismConfig": "foundry.distributed.config",
    "RunConfig": "foundry.run_config",
    "ConfigError": "foundry.errors",
    "DataError": "foundry.errors",
    "FoundryError": "foundry.errors",
    "Trainer": "foundry.trainer",
    "TrainingError": "foundry.errors",
    "generate": "foundry.inference",
    "load_model": "foundry.inference",
    "registry": "foundry.registry",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'foundry' has no attribute '{name}'")
    value = importlib.import_module(module)
    return value if name == "registry" else getattr(value, name)
