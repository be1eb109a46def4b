"""The MoE router's projection on a GPU: its three GEMMs (forward, input gradient, weight gradient), each with the
kernel it launches, beside other ways to compute it, at OLMoE-1B-7B's shape (d_model 2048, 64 experts) and the
65,536 tokens of its shipped microbatch. Each GEMM has one dimension of 64 (the experts), the skinny shape where a
BLAS library's kernel choice can fall far short of the memory bound; every way is checked against fp32.

    python benchmarks/moe.py --parts router --out $OUT
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_utils import cuda_time_ms
from torch.profiler import ProfilerActivity, profile

D_MODEL, EXPERTS = 2048, 64


def _split_k_wgrad(chunks: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """grad.T @ x as ``chunks`` batched GEMMs over slices of the tokens, summed in fp32 (a split-K by hand)."""

    def wgrad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        parts = torch.bmm(
            grad.view(chunks, -1, grad.shape[1]).transpose(1, 2),
            x.view(chunks, -1, x.shape[1]),
            out_dtype=torch.float32,
        )
        return parts.sum(0).to(x.dtype)

    return wgrad


def _autotuned(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` compiled with inductor's GEMM autotuning (Triton templates beside cuBLAS)."""
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)


def variants() -> dict[str, dict[str, Callable[..., torch.Tensor]]]:
    """Each GEMM's ways, by name; the first is what ``nn.Linear`` runs."""
    return {
        "forward": {  # (x, weight) -> x @ weight.T
            "linear": lambda x, w: torch.nn.functional.linear(x, w),
            "transposed_problem": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
            "fp32": lambda x, w: torch.nn.functional.linear(x.float(), w.float()).to(x.dtype),
            "autotuned": _autotuned(lambda x, w: torch.nn.functional.linear(x, w)),
        },
        "input_grad": {  # (grad, weight) -> grad @ weight
            "mm": lambda g, w: g @ w,
            "transposed_problem": lambda g, w: torch.mm(w.t(), g.t()).t().contiguous(),
            "fp32": lambda g, w: (g.float() @ w.float()).to(g.dtype),
            "autotuned": _autotuned(lambda g, w: g @ w),
        },
        "weight_grad": {  # (grad, x) -> grad.T @ x
            "mm": lambda g, x: g.t() @ x,
            "transposed_problem": lambda g, x: torch.mm(x.t(), g).t().contiguous(),
            "split_k_8": _split_k_wgrad(8),
            "split_k_32": _split_k_wgrad(32),
            "autotuned": _autotuned(lambda g, x: g.t() @ x),
        },
    }


def _kernels(fn: Callable[[], Any]) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, by name (trimmed)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name[:90] for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def router_rows(token_counts: tuple[int, ...] = (65536,)) -> list[dict[str, Any]]:
    """Median ms, kernels and error against fp32 of each way of each router GEMM, per token count."""
    torch.manual_seed(0)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, D_MODEL, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(EXPERTS, D_MODEL, device="cuda", dtype=torch.bfloat16) * 0.02
        grad = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
        references = {
            "forward": ((x, weight), x.float() @ weight.float().t()),
            "input_grad": ((grad, weight), grad.float() @ weight.float()),
            "weight_grad": ((grad, x), grad.float().t() @ x.float()),
        }
        for gemm, ways in variants().items():
            inputs, reference = references[gemm]
            for name, fn in ways.items():
                row = {"gemm": gemm, "tokens": tokens, "way": name}
                rows.append({**row, **_measured(fn, inputs, reference, tokens, kernels=name != "autotuned")})
    return rows


def _measured(
    fn: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    reference: torch.Tensor,
    tokens: int,
    kernels: bool,
) -> dict[str, Any]:
    """``fn(*inputs)``'s median time, TFLOP/s, error against ``reference`` and kernels; or why it failed."""
    try:
        out = fn(*inputs)
        times = sorted(cuda_time_ms(lambda: fn(*inputs), warmup=5, iters=30))
    except Exception as error:  # an alternative that does not run here is a row that says why
        return {"error": str(error).splitlines()[0][:200]}
    median = times[len(times) // 2]
    error = (out.float() - reference).abs().max() / reference.abs().max()
    return {
        "median_ms": round(median, 4),
        "tflops": round(2 * tokens * D_MODEL * EXPERTS / median / 1e9, 1),  # every one of the three GEMMs
        "max_rel_err_vs_fp32": round(error.item(), 6),
        "kernels": _kernels(lambda: fn(*inputs)) if kernels else [],
    }
