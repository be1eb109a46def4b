"""Secrets never leave the process: configs are scrubbed before loggers, files and checkpoints see them.

A value is secret when its key names one (``api_key``, ``hf_token``, ``client_secret``, ``password``,
``access_key``, case-insensitive, at any depth) or when it holds the value of a secret environment variable
(``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``AZURE_ACCOUNT_ACCESS_KEY``, ...). Secrets
become ``'***'``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from typing import Any

REDACTED = "***"
# Matched against snake_case keys: 'token' must stand alone ('hf_token', 'hfToken') so that 'tokenizer'
# and 'max_tokens' are kept.
_SECRET_KEY = re.compile(r"api_?key|access_?key|secret|passw(?:or)?d|credential|(?<![a-z])token(?![a-z])")
_MIN_SECRET_LENGTH = 8  # shorter env values ('1', 'true') would redact ordinary config values


def scrub_secrets(config: Any, secret_values: Collection[str] | None = None) -> Any:
    """A JSON-plain copy of ``config`` with secrets replaced by ``'***'``.

    A value is secret when its key names one (``api_key``, ``hf_token``, ``client_secret``, ``password``,
    case-insensitive, at any depth) or when it holds the value of a secret environment variable.

    Args:
        config: nested dicts and lists; other values become numbers, strings, booleans or None.
        secret_values: strings to redact wherever they appear; default: secret environment variables' values.
    """
    secrets = environment_secrets() if secret_values is None else [s for s in secret_values if s]
    plain = json.loads(json.dumps(config, default=str))  # Time, Path and friends become strings
    return _scrub(plain, secrets)


def environment_secrets() -> list[str]:
    """Values of environment variables whose names name a secret (``WANDB_API_KEY``, ``HF_TOKEN``...)."""
    return [value for name, value in os.environ.items() if is_secret_key(name) and len(value) >= _MIN_SECRET_LENGTH]


def is_secret_key(key: str) -> bool:
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()  # 'hfToken' -> 'hf_token'
    return _SECRET_KEY.search(snake) is not None


def _scrub(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, dict):
        return {key: REDACTED if is_secret_key(key) else _scrub(item, secrets) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item, secrets) for item in value]
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value
