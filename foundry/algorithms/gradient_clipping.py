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
            state.grad_norm = clip_grad_norm(parameters, self.clipping_threshold)
        else:
            torch.nn.utils.clip_grad_value_(parameters, self.clipping_threshold, foreach=True)


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip to a global norm ``max_norm``; returns the pre-clip norm (a plain tensor, on device).

    foreach keeps it to a handful of kernels. Sharded (FSDP2 DTensor) gradients give the global norm
    over all ranks' shards, as a replicated DTensor. Gradients on several meshes (expert-parallel
    experts beside FSDP's shards) cannot meet in one foreach: each mesh's norm is taken apart, then combined.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        by_mesh.setdefault(parameter.device_mesh if isinstance(parameter, DTensor) else None, []).append(parameter)
    if len(by_mesh) == 1:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
