"""One switch per feature: an old spelling keeps working and says once, per process, what replaces it."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


class FoundryDeprecationWarning(FutureWarning):
    """An old foundry spelling that still works and will be removed (a ``FutureWarning``: shown by default)."""


def warn_deprecated(old: str, new: str) -> None:
    """A ``FoundryDeprecationWarning`` that ``old`` is deprecated and what to write instead; once per ``old``."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated and will be removed; {new}", FoundryDeprecationWarning, stacklevel=3)


def reset() -> None:
    """Forget which spellings were warned about (tests start each from none)."""
    _WARNED.clear()
