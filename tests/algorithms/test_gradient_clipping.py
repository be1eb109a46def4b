"""gradient_clipping on vs off: a threshold above the gradients changes nothing; a low one clips (norm and value)."""

from __future__ import annotations

import pytest
import torch

from foundry.algorithms import GradientClipping
from foundry.core import Callback


class GradsBeforeStep(Callback):
    """The gradients the optimizer is about to use (callbacks run after algorithms)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def before_optimizer_step(self, state, logger) -> None:
        self.grads = [p.grad.detach().clone() for p in state.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("clipping_type", ["norm", "value"])
def test_threshold_above_the_gradients_changes_nothing(train, clipping_type):
    _, plain = train()
    _, clipped = train([GradientClipping(clipping_type, clipping_threshold=1e6)])
    assert clipped == plain


def test_norm_clipping_bounds_the_global_norm(train):
    grads = GradsBeforeStep()
    trainer, _ = train([GradientClipping("norm", clipping_threshold=0.01)], callbacks=[grads], num_batches=1)
    clipped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.grads]))
    assert clipped_norm == pytest.approx(0.01, rel=1e-3)
    assert trainer.state.grad_norm > 0.01  # the pre-clip norm, for monitors


def test_value_clipping_bounds_every_element(train):
    grads = GradsBeforeStep()
    train([GradientClipping("value", clipping_threshold=1e-3)], callbacks=[grads], num_batches=1)
    assert max(g.abs().max() for g in grads.grads) <= 1e-3
