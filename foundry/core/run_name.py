"""A run's name: the default one, whether a user gave it, and ``{run_name}`` in the paths that take it."""

from __future__ import annotations

import os
import re
import secrets
import time


def default_run_name() -> str:
    """``$RUN_NAME`` (or Composer's ``$COMPOSER_RUN_NAME``), else ``foundry-<date>-<time>-<hex>``: the random
    suffix keeps two launches of the same second apart (their metrics would share a run folder)."""
    generated = f"foundry-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    return os.environ.get("RUN_NAME") or os.environ.get("COMPOSER_RUN_NAME") or generated


_GENERATED_RUN_NAME = re.compile(r"^foundry-\d{8}-\d{6}(-[0-9a-f]{4})?$")  # without the suffix: older foundry's


def is_generated_run_name(run_name: str) -> bool:
    """Whether ``run_name`` is one ``default_run_name`` made up (``foundry-<date>-<time>-<hex>``), not a user's."""
    return bool(_GENERATED_RUN_NAME.match(run_name))


def fill_run_name(path: str | None, run_name: str) -> str | None:
    """``path`` with ``{run_name}`` filled in (Composer's convention); other braces, like ``{rank}``, stay."""
    return path.replace("{run_name}", run_name) if path is not None else None
