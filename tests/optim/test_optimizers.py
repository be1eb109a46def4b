"""Optimizers by YAML name: decoupled_lionw is Lion with LLM Foundry's decoupled weight decay."""

from __future__ import annotations

import torch

from foundry import registry
from foundry.optim import DecoupledLionW


def test_lion_steps_by_the_sign_of_the_interpolated_momentum() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    optimizer = DecoupledLionW([param], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    param.grad = torch.tensor([0.5, 0.5, -1.0])
    optimizer.step()
    # moment starts at 0: update = sign(0.1 * g); weights first shrink by 1 - 0.5 * lr / initial_lr = 0.5
    torch.testing.assert_close(param.detach(), torch.tensor([0.5 - 0.1, -1.0 - 0.1, 1.5 + 0.1]))
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], 0.01 * torch.tensor([0.5, 0.5, -1.0]))


def test_registered_as_decoupled_lionw() -> None:
    assert registry.optimizers.get("decoupled_lionw") is DecoupledLionW
