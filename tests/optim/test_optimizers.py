"""Optimizers by YAML name: decoupled_lionw is Lion with LLM Foundry's decoupled weight decay; Adam's bf16 moments."""

from __future__ import annotations

import pytest
import torch

from foundry import registry
from foundry.errors import ConfigError
from foundry.optim import DecoupledAdamW, DecoupledLionW
from foundry.optim.optimizers import adamw


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


def adam_trajectory(optimizer_factory, steps: int = 30) -> tuple[torch.Tensor, dict]:
    """Weights after ``steps`` steps on a fixed least-squares problem, and the optimizer's state of them."""
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    weight = torch.nn.Parameter(torch.zeros(8, 1))
    optimizer = optimizer_factory([weight])
    for _ in range(steps):
        loss = ((inputs @ weight - targets) ** 2).mean()
        weight.grad = torch.autograd.grad(loss, weight)[0]
        optimizer.step()
    return weight.detach(), optimizer.state[weight]


@pytest.mark.parametrize("name", ["decoupled_adamw", "adamw"])
def test_bf16_moments_are_stored_in_bf16_and_follow_fp32_adam(name) -> None:
    build = registry.optimizers.get(name)
    keys = {"lr": 0.05, "weight_decay": 0.1}
    want, fp32_state = adam_trajectory(lambda params: build(params, **keys))
    got, state = adam_trajectory(lambda params: build(params, moments_dtype="bfloat16", **keys))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert fp32_state["exp_avg"].dtype == torch.float32 and got.dtype == torch.float32
    assert float(state["step"]) == 30
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-2)  # bf16's 8-bit mantissa, not a different method


def test_one_step_with_bf16_moments_is_torchs_step_when_the_moments_round_exactly() -> None:
    # gradients that bf16 holds exactly: after one step both moments are exact, so the weights are torch's
    weights = [torch.nn.Parameter(torch.tensor([1.0, -2.0])) for _ in range(2)]
    optimizers = [torch.optim.AdamW([weights[0]], lr=0.1), adamw([weights[1]], lr=0.1, moments_dtype="bfloat16")]
    for weight, optimizer in zip(weights, optimizers):
        weight.grad = torch.tensor([0.5, -0.25])
        optimizer.step()
    torch.testing.assert_close(weights[1], weights[0], atol=0, rtol=0)


def test_an_unknown_moments_dtype_names_the_key() -> None:
    with pytest.raises(ConfigError, match="optimizer.moments_dtype"):
        DecoupledAdamW([torch.nn.Parameter(torch.zeros(1))], moments_dtype="float16")


@pytest.mark.parametrize("name", ["decoupled_adamw", "adamw"])
def test_fused_with_bf16_moments_is_refused_naming_both_keys(name) -> None:
    build = registry.optimizers.get(name)
    with pytest.raises(ConfigError, match=r"'optimizer\.fused'.*'optimizer\.moments_dtype'"):
        build([torch.nn.Parameter(torch.zeros(1))], fused=True, moments_dtype="bfloat16")
    unfused = build([torch.nn.Parameter(torch.zeros(1))], fused=False, moments_dtype="bfloat16")
    assert isinstance(unfused, torch.optim.AdamW)


@pytest.mark.parametrize("name", ["decoupled_adamw", "adamw"])
def test_bf16_moments_stay_bf16_after_a_resumed_optimizer_state(name) -> None:
    build = registry.optimizers.get(name)
    weight = torch.nn.Parameter(torch.ones(4))
    first = build([weight], lr=0.1, moments_dtype="bfloat16")
    weight.grad = torch.full((4,), 0.5)
    first.step()
    resumed = build([weight], lr=0.1, moments_dtype="bfloat16")
    resumed.load_state_dict(first.state_dict())  # torch casts loaded state to the parameter's dtype (fp32)
    resumed.step()
    assert resumed.state[weight]["exp_avg"].dtype == resumed.state[weight]["exp_avg_sq"].dtype == torch.bfloat16
