"""Optional dependencies, imported where a feature first needs them so that the rest of foundry runs without them."""

from __future__ import annotations

import importlib
from types import ModuleType

from foundry.errors import FoundryError


def import_optional(
    module: str, *, needed_for: str, package: str, install: str, error: type[FoundryError] = FoundryError
) -> ModuleType:
    """Import ``module``, or raise ``error`` naming what needs it and the command that installs it.

    Args:
        module: the module to import, e.g. ``"streaming"`` or ``"matplotlib.figure"``.
        needed_for: what needs it, as the message's subject, e.g. ``"loggers.wandb"``.
        package: the distribution to install, as the message names it, e.g. ``"the wandb package"``.
        install: the command that installs it, e.g. ``"pip install 'foundry[wandb]'"``.
        error: the FoundryError subclass to raise (ConfigError where a YAML key asked for the feature).
    """
    try:
        return importlib.import_module(module)
    except ImportError as cause:
        raise error(
            f"{needed_for} needs {package}, which cannot be imported ({cause}). Install it with: {install}"
        ) from None
