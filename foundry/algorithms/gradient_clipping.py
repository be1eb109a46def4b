"""Gradient clipping, applied once per batch after all microbatches' gradients have accumulated.

Under FSDP2 each rank holds gradient shards (DTensors); ``clip_grad_norm_`` reduces their norms
over the ranks, so the clipped norm is the global one (tests/distributed/test_gradient_clipping.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State


@registry.algorithms.register("gradient_clipping")
class GradientClipping(Algorithm):
    """Clip by global norm (``norm``) or per element (``value``) before the optimizer steps.

    The pre-clip global norm goes to ``state.grad_norm`` on device (no host sync), where nan_guard and
    the optimizer monitor reuse it.
    """

    def __init__(self, clipping_type: Literal["norm", "value"] = "norm", clipping_threshold: float = 1.0) -> None:
        self.clipping_type = clipping_type
        self.clipping_threshold = clipping_threshold

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_OPTIMIZER_STEP

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        parameters = [p for p in state.model.parameters() if p.grad is not None]
        if self.clipping_type == "norm":
            # foreach=True keeps it to a handful of kernels. Sharded (FSDP2 DTensor) gradients give the
            # global norm over all ranks' shards, as a replicated DTensor: keep its plain local value.
            norm = torch.nn.utils.clip_grad_norm_(parameters, self.clipping_threshold, foreach=True)
            state.grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        else:
            torch.nn.utils.clip_grad_value_(parameters, self.clipping_threshold, foreach=True)
