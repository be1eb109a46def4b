"""A run's name: the default one, whether a user gave it, and ``{run_name}`` in the paths that take it."""

from __future__ import annotations

import os
import re
import time


def default_run_name() -> str:
    """``$RUN_NAME`` (or Composer's ``$COMPOSER_RUN_NAME``), else ``foundry-<date>-<time>``."""
    return (
        os.environ.get("RUN_NAME") or os.environ.get("COMPOSER_RUN_NAME") or f"foundry-{time.strftime('%Y%m%d-%H%M%S')}"
    )


_GENERATED_RUN_NAME = re.compile(r"^foundry-\d{8}-\d{6}$")


def is_generated_run_name(run_name: str) -> bool:
    """Whether ``run_name`` is one ``default_run_name`` made up (``foundry-<date>-<time>``), not one a user gave."""
    return bool(_GENERATED_RUN_NAME.match(run_name))


def fill_run_name(path: str | None, run_name: str) -> str | None:
    """``path`` with ``{run_name}`` filled in (Composer's convention); other braces, like ``{rank}``, stay."""
    return path.replace("{run_name}", run_name) if path is not None else None
