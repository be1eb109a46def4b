"""Adam's bf16 moments on FSDP2-sharded parameters: stepped on the local shards, kept as DTensors."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from foundry.optim import DecoupledAdamW


def sharded_step_with_bf16_moments() -> dict:
    """Three steps of a FSDP2-sharded linear layer with bf16 moments; its full weight and state types."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 6, bias=False)
    fully_shard(layer)
    optimizer = DecoupledAdamW(layer.parameters(), lr=0.1, weight_decay=0.1, moments_dtype="bfloat16")
    inputs = torch.arange(8.0).view(2, 4)
    for _ in range(3):
        layer(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state[layer.weight]
    return {"weight": layer.weight.full_tensor().detach(), "sharded_state": isinstance(state["exp_avg"], DTensor)}


def test_bf16_moments_step_sharded_parameters_like_whole_ones(ranks) -> None:
    plain, sharded = ranks.run(1, sharded_step_with_bf16_moments)[0], ranks.run(2, sharded_step_with_bf16_moments)[0]
    assert sharded["sharded_state"]
    torch.testing.assert_close(sharded["weight"], plain["weight"], atol=1e-6, rtol=0)
