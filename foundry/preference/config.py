"""The ``preference`` section of a run: which preference loss, its β, and where reference log-probabilities come from.

Kept apart from the objective so that reading a YAML does not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from foundry.errors import ConfigError
from foundry.schema import doc

LossType = Literal["sigmoid", "ipo", "simpo"]
LOSS_TYPES: tuple[LossType, ...] = ("sigmoid", "ipo", "simpo")
AVERAGES_PER_TOKEN = ("ipo", "simpo")  # these losses read log-probabilities averaged over response tokens
REFERENCE_FREE = ("simpo",)
Reference = Literal["auto", "copy", "adapters_off", "precomputed", "none"]


@dataclasses.dataclass(kw_only=True)
class PreferenceConfig:
    """The ``preference`` section: which loss, its β, and where the reference log-probabilities come from."""

    loss_type: LossType = dataclasses.field(default="sigmoid", metadata=doc("sigmoid (DPO), ipo or simpo"))
    beta: float = dataclasses.field(default=0.1, metadata=doc("β: how far the policy may move from the reference"))
    label_smoothing: float = dataclasses.field(
        default=0.0, metadata=doc("sigmoid and simpo: assumed share of flipped labels (conservative DPO), in [0, 0.5)")
    )
    gamma_beta_ratio: float = dataclasses.field(default=0.5, metadata=doc("simpo: the target margin γ over β"))
    reference: Reference = dataclasses.field(
        default="auto",
        metadata=doc("copy, adapters_off (LoRA), precomputed (once, beside the data), none (simpo); auto: LoRA's base"),
    )
    reference_model: dict[str, Any] | None = dataclasses.field(
        default=None, metadata=doc("a model section built as the reference instead (same vocabulary)")
    )

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"'preference.loss_type' is {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)}.")
        if not self.beta > 0:
            raise ConfigError(
                f"'preference.beta' is {self.beta}; β must be positive (TRL's default is 0.1): it scales the "
                "log-probability ratios, and β ≤ 0 would reward moving away from the chosen responses."
            )
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"'preference.label_smoothing' is {self.label_smoothing}; use a value in [0, 0.5).")
        if self.label_smoothing and self.loss_type == "ipo":
            raise ConfigError("'preference.label_smoothing' applies to sigmoid and simpo, not ipo; set it to 0.")
        reference_free = self.loss_type in REFERENCE_FREE
        if reference_free and (self.reference not in ("auto", "none") or self.reference_model is not None):
            raise ConfigError(f"'preference.reference' is set, but {self.loss_type} is reference-free; remove it.")
        if self.reference_model is not None and self.reference not in ("auto", "copy"):
            raise ConfigError("'preference.reference_model' is set, so 'preference.reference' must be copy or auto.")
        if not reference_free and self.reference == "none":
            raise ConfigError(f"'preference.reference' is none, but {self.loss_type} needs one; use simpo, or copy.")
