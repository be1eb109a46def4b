"""Preference tuning (DPO, IPO, SimPO) as a training objective: ``PreferenceObjective``, its config and losses.

Importing this package does not import torch; the objective and the losses load on first use.
"""

from __future__ import annotations

from foundry.lazy import lazy_exports

_EXPORTS = {
    "PreferenceConfig": "foundry.preference.config",
    "PreferenceObjective": "foundry.preference.objective",
    "preference_loss": "foundry.preference.losses",
    "sequence_logps": "foundry.preference.logps",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
