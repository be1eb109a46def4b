"""On a Hopper-class GPU: the grouped-GEMM MoE against the per-expert loop, in bf16, forward and backward."""

from __future__ import annotations

import pytest
import torch
from helpers import builds_graphs

from foundry.models.experts import grouped_mm_runs_on
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not grouped_mm_runs_on(torch.device("cuda"), torch.bfloat16),
    reason="needs a CUDA GPU where torch's grouped GEMM runs (compute capability 9.0+)",
)


def run(moe: torch.nn.Module, x: torch.Tensor, use_grouped_mm: bool | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward and backward of ``moe`` (an MoE, or a compiled one); its output and the input's and experts' grads."""
    layer = getattr(moe, "_orig_mod", moe)
    layer.experts.use_grouped_mm = use_grouped_mm
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = moe(x)
    out.float().square().mean().backward()
    return out.float(), [x.grad, *(p.grad for p in layer.experts.parameters())]


@pytest.mark.parametrize("tokens", [4096, 37])  # 37: most experts get a group that is not a multiple of 8
def test_grouped_gemm_matches_the_per_expert_loop_in_bf16(tokens: int) -> None:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, glu=True, act=ActFnConfig("silu"))
    moe = MoE(512, config).cuda()
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    x = torch.randn(1, tokens, 512, device="cuda")
    grouped, grouped_grads = run(moe, x, None)
    loop, loop_grads = run(moe, x, False)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
    for grouped_grad, loop_grad in zip(grouped_grads, loop_grads, strict=True):
        # relative to the gradient's own norm: an absolute tolerance would pass a zero gradient, these are small
        assert loop_grad.norm() > 0
        assert (grouped_grad.float() - loop_grad.float()).norm() <= 2e-2 * loop_grad.float().norm()


def test_compiled_grouped_moe_matches_eager() -> None:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, glu=True, act=ActFnConfig("silu"))
    moe = MoE(512, config).cuda()
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    x = torch.randn(2, 512, 512, device="cuda")
    eager, eager_grads = run(moe, x, None)
    with builds_graphs():
        compiled, compiled_grads = run(torch.compile(moe, fullgraph=True), x, None)  # one graph: no break
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):  # the permutation's backward
        assert (compiled_grad.float() - eager_grad.float()).norm() <= 2e-2 * eager_grad.float().norm()


def test_forward_and_backward_never_wait_for_the_host() -> None:
    """Routing, layout, grouped GEMMs and their backward queue work without a device sync (no .item(), no
    bincount, no size read back): the host runs ahead, and FSDP's prefetches overlap the layer."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, glu=True, act=ActFnConfig("silu"))
    moe = MoE(512, config).cuda()
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    x = torch.randn(1, 1024, 512, device="cuda", requires_grad=True)
    run(moe, x, None)  # lazy initialisation (cuBLAS handles, allocator) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and moe.routing is not None


def test_grouped_mm_takes_groups_of_any_size() -> None:
    """torch's bf16 grouped GEMM on unpadded groups (sizes 0, 1, 13, 50): forward and both gradients against a
    per-group matmul. Where this passes, ``GROUPED_MM_ROW_ALIGNMENT`` 1 would be correct on this torch."""
    torch.manual_seed(0)
    sizes = [13, 0, 1, 50]
    x = torch.randn(sum(sizes), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(len(sizes), 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).int()
    out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, weight], grad_out)
    x_ref, weight_ref = x.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    expected = torch.cat([group @ w.T for group, w in zip(x_ref.split(sizes), weight_ref)])
    expected_grads = torch.autograd.grad(expected, [x_ref, weight_ref], grad_out.float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-1)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert (grad.float() - expected_grad).norm() <= 1e-2 * expected_grad.norm()
