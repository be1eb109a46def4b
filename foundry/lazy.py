"""Package namespaces that import a name's module on first use, so importing a package costs nothing.

A config parses, and ``foundry train --help`` or a config error answers, without importing torch:
``foundry/core/__init__.py`` and the other package ``__init__`` files name where each export lives
and let ``lazy_exports`` load it when it is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``exports`` map each name to the module defining it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
