"""What a training step minimises, given the model and a microbatch: by default the model's own loss.

The Trainer asks its ``Objective`` for each step's outputs, loss, loss weight and logged terms, so an objective
that is not the model's next-token loss (``foundry.preference``: DPO) keeps the model itself unchanged: its
checkpoints, sharding, LoRA and Hugging Face export stay those of the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from foundry.models.base import FoundryModel


class Objective:
    """The model's own loss; subclasses change what a step computes (the Trainer's loop stays the same)."""

    def attach(self, model: FoundryModel) -> None:
        """Called once with the model as given, before algorithms change it and before it is placed."""

    def modules_to_place(self) -> list[nn.Module]:
        """Further modules the Trainer places (moves, shards) as it places the model."""
        return []

    def after_load(self, state: Any, load_path: str | None) -> None:
        """Called once the run's starting checkpoint (``load_path`` or the run's own) is loaded into ``state``."""

    def forward(self, model: FoundryModel, batch: Mapping[str, Any]) -> Any:
        return model(batch)

    def loss(self, model: FoundryModel, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """Mean loss over ``loss_weight(model, batch)`` units."""
        return model.loss(outputs, batch)

    def loss_weight(self, model: FoundryModel, batch: Mapping[str, Any]) -> torch.Tensor | int:
        return model.loss_weight(batch)

    def logged_terms(self, model: FoundryModel) -> dict[str, torch.Tensor]:
        """Values of the last ``loss`` logged under these names, weighted over microbatches and ranks as the loss."""
        return {f"loss/train/{name}": term for name, term in model.loss_terms().items()}

    def correct_predictions(self, model: FoundryModel, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
        return model.correct_predictions(outputs, batch)

    def llm_foundry_metrics(
        self, model: FoundryModel, loss: torch.Tensor, correct: torch.Tensor | None, weight: torch.Tensor
    ) -> dict:
        return model.llm_foundry_metrics(loss, correct, weight)

    def eval_metrics_from_loss(self, model: FoundryModel, loss: float) -> dict[str, float]:
        return model.eval_metrics_from_loss(loss)
