"""Expert parallelism on 2 gloo ranks against one rank's MoE: the same outputs and gradients, the same checkpoint."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from foundry.distributed.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from foundry.models.init import InitConfig, init_weights_
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig

D_MODEL = 8


def tiny_moe() -> MoE:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=6, glu=True, act=ActFnConfig("silu"))
    moe = MoE(D_MODEL, config)
    init_weights_(moe, InitConfig(name="baseline_", init_std=0.3), n_layers=2, d_model=D_MODEL)
    return moe


def exchange_matches_one_rank() -> bool:
    rank = dist.get_rank()
    reference = tiny_moe()
    sharded = copy.deepcopy(reference)
    assert apply_expert_parallel(sharded, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))) == 1
    assert isinstance(sharded.experts, ExpertParallelExperts)
    torch.manual_seed(10 + rank)  # each rank routes its own tokens, unevenly (rank 1 has more)
    x = torch.randn(1, 5 + 3 * rank, D_MODEL)
    x_ref = x.clone().requires_grad_(True)
    x = x.requires_grad_(True)
    out, expected = sharded(x), reference(x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sharded.router.layer.weight.grad, reference.router.layer.weight.grad)
    for name in ("up_proj", "gate_proj", "down_proj"):
        full_grad = getattr(reference.experts, name).grad.clone()
        dist.all_reduce(full_grad)  # each rank's tokens reach the experts: their gradients add up
        local = getattr(sharded.experts, name).grad.to_local()
        torch.testing.assert_close(local, full_grad[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-6)
        full_weight = getattr(sharded.experts, name).full_tensor()
        torch.testing.assert_close(full_weight, getattr(reference.experts, name).detach())
    return True


def test_dispatch_and_combine_over_two_ranks_equal_one_rank(ranks) -> None:
    assert ranks.run(2, exchange_matches_one_rank) == [True, True]
