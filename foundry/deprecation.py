"""One switch per feature: an old spelling keeps working and says once, per process, what replaces it."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
    """A ``FutureWarning`` (shown by default) that ``old`` is deprecated and what to write instead; once per ``old``."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated and will be removed; {new}", FutureWarning, stacklevel=3)
