"""Gradient clipping, applied once per batch after all microbatches' gradients have accumulated."""

from __future__ import annotations

from typing import Literal

import torch

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State


@registry.algorithms.register("gradient_clipping")
class GradientClipping(Algorithm):
    """Clip by global norm (``norm``) or per element (``value``) before the optimizer steps.

    The total norm is kept on device as ``last_grad_norm`` (no host sync); the optimizer
    monitor logs it at logging intervals.
    """

    def __init__(self, clipping_type: Literal["norm", "value"] = "norm", clipping_threshold: float = 1.0) -> None:
        self.clipping_type = clipping_type
        self.clipping_threshold = clipping_threshold
        self.last_grad_norm: torch.Tensor | None = None

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_OPTIMIZER_STEP

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        parameters = [p for p in state.model.parameters() if p.grad is not None]
        if self.clipping_type == "norm":
            # foreach=True keeps it to a handful of kernels; with DTensor grads the norm is global.
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.clipping_threshold, foreach=True)
        else:
            torch.nn.utils.clip_grad_value_(parameters, self.clipping_threshold, foreach=True)
