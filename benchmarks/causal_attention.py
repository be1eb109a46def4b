"""Causal attention kernels head to head on the shapes of the shipped configs (forward, and forward + backward).

    python benchmarks/causal_attention.py --kernels cudnn flash2 flex flex-autotune fa4 --out OUT

Each kernel gets q, k and v the way the models make them: strided views of one fused (batch, seq,
heads * head_dim * 3) projection, and the backward's gradient flows back into that projection, so
the timings include what each kernel's layout costs (transposes, the concatenation of dq, dk, dv).
FLOPs are counted as the models count them (the full seq² square, backward = 2 × forward), so the
TFLOP/s columns compare with the MFU tables; the causal half the kernels skip is not discounted.

Kernels:
- ``cudnn``, ``flash2``, ``efficient``: SDPA pinned to one backend (``is_causal=True``).
- ``flex``: FlexAttention with a causal block mask, compiled (inductor's default launch configs);
  ``flex-autotune``: the same compiled with ``max-autotune-no-cudagraphs`` (inductor tries its configs).
- ``fa4``: FlashAttention-4 (``flash_attn.cute``, the CuTe-DSL kernels with an SM90 path), where installed;
  it takes (batch, seq, heads, head_dim) views, so no transpose is needed. ``sdpa-fa4``: SDPA's flash
  backend after ``torch.nn.attention.activate_flash_attention_impl("FA4")`` (torch 2.11+; process-wide, so last).
- ``foundry-fa4``: foundry's two custom ops around the same kernels (``foundry/models/flash_attention4.py``),
  what ``attn_impl: flash`` runs; ``fa4-packed-grads``: the same kernels writing dq, dk and dv straight into
  one gradient of the fused projection (no concatenation), to measure what that layout would save.
A kernel that cannot run reports its error instead of a number.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_utils import cuda_time_ms, write_results
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, n_heads, kv_heads, seq, head_dim): the attention of each shipped config at a microbatch
# whose attention work is comparable (MPT-125M at 16, the 1B configs at 4).
SHAPES = {
    "mpt-125m": (16, 12, 12, 2048, 64),
    "llama-1b": (4, 32, 8, 2048, 64),
    "mpt-1b": (4, 16, 16, 2048, 128),
    "llama-8b": (4, 32, 8, 2048, 128),  # llama-8b.yaml's microbatch: FA2 takes its 8 kv heads, cuDNN repeats them
}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (b, s, h, d) views -> (b, s, h, d)


def sdpa(backend: SDPBackend) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if backend == SDPBackend.CUDNN_ATTENTION and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)

    return run


def flex(mode: str | None) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, mode=mode)
    masks: dict[int, object] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.shape[1]
        if seq not in masks:
            masks[seq] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device=q.device)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = compiled(q, k, v, block_mask=masks[seq], enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)

    return run


def fa4() -> Attention:
    from flash_attn.cute import flash_attn_func

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def foundry_fa4() -> Attention:
    from foundry.models.flash_attention4 import flash_attention4

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = 1 / math.sqrt(q.shape[-1])
        return flash_attention4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)

    return run


class _PackedGradsFA4(torch.autograd.Function):
    """FA4 on views of a fused projection whose backward writes dq, dk, dv into one (b, s, width) gradient."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, widths: list[int], head_dim: int) -> torch.Tensor:  # type: ignore[override]
        from flash_attn.cute.interface import _flash_attn_fwd

        q, k, v = split(qkv, widths, head_dim)
        out, lse = _flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
        ctx.save_for_backward(qkv, out, lse)
        ctx.widths, ctx.head_dim = widths, head_dim
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        from flash_attn.cute.interface import _flash_attn_bwd

        qkv, out, lse = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv)
        q, k, v = split(qkv, ctx.widths, ctx.head_dim)
        dq, dk, dv = split(grad_qkv, ctx.widths, ctx.head_dim)
        _flash_attn_bwd(q, k, v, out, grad_out.contiguous(), lse, causal=True, dq=dq, dk=dk, dv=dv)
        return grad_qkv, None, None


def sdpa_fa4() -> Attention:
    """SDPA's flash backend with torch's FA4 registration activated (process-wide: run it last)."""
    torch.nn.attention.activate_flash_attention_impl("FA4")
    return sdpa(SDPBackend.FLASH_ATTENTION)


KERNELS: dict[str, Callable[[], Attention]] = {
    "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
    "flash2": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
    "efficient": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION),
    "flex": lambda: flex(None),
    "flex-autotune": lambda: flex("max-autotune-no-cudagraphs"),
    "fa4": fa4,
    "foundry-fa4": foundry_fa4,
    "sdpa-fa4": sdpa_fa4,
}
PACKED_KERNELS = {"fa4-packed-grads"}  # take the fused projection itself, not its q, k, v views


def packed_inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int) -> tuple[torch.Tensor, list[int]]:
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(batch, seq, sum(widths), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return qkv, widths


def split(qkv: torch.Tensor, widths: list[int], head_dim: int) -> tuple[torch.Tensor, ...]:
    return tuple(part.unflatten(-1, (-1, head_dim)) for part in qkv.split(widths, dim=-1))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 math: what every kernel's output and gradient are checked against (on the first sequence)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    return (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def measure(kernel: str, shape_name: str, warmup: int, iters: int) -> dict:
    batch, heads, kv_heads, seq, head_dim = SHAPES[shape_name]
    row = {"kernel": kernel, "shape": shape_name, "batch": batch, "heads": heads, "kv_heads": kv_heads,
           "seq": seq, "head_dim": head_dim}  # fmt: skip
    try:
        qkv, widths = packed_inputs(batch, heads, kv_heads, seq, head_dim)
        if kernel in PACKED_KERNELS:

            def attention(*_views: torch.Tensor) -> torch.Tensor:
                return _PackedGradsFA4.apply(qkv, widths, head_dim)
        else:
            attention = KERNELS[kernel]()
        grad = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        started = time.perf_counter()
        out = attention(*split(qkv, widths, head_dim))
        out.backward(grad)
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - started
        first = qkv.detach()[:1].float().requires_grad_()
        expected = reference(*split(first, widths, head_dim))
        expected.backward(grad[:1].float())
        row["max_abs_err"] = (out[:1].float() - expected).abs().max().item()
        row["max_abs_grad_err"] = (qkv.grad[:1].float() - first.grad).abs().max().item()
        qkv.grad = None

        def forward() -> None:
            with torch.no_grad():
                attention(*split(qkv, widths, head_dim))

        def forward_backward() -> None:
            attention(*split(qkv, widths, head_dim)).backward(grad)
            qkv.grad = None

        flops = 4 * batch * heads * seq**2 * head_dim
        row["fwd_ms"] = statistics.median(cuda_time_ms(forward, warmup, iters))
        row["fwd_bwd_ms"] = statistics.median(cuda_time_ms(forward_backward, warmup, iters))
        row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["bwd_tflops"] = 2 * flops / row["bwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_ms"] / 1e9
    except Exception as error:  # a kernel that cannot run is a result, not a crash
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
        traceback.print_exc()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--kernels", nargs="+", default=["cudnn", "flash2", "flex"], choices=sorted([*KERNELS, *PACKED_KERNELS])
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one FlexAttention graph per shape and kernel variant
    if not torch.cuda.is_available():
        print("causal_attention.py times CUDA kernels; no CUDA device here.", file=sys.stderr)
        return 1
    rows = []
    for shape_name in args.shapes:
        for kernel in args.kernels:
            row = measure(kernel, shape_name, args.warmup, args.iters)
            rows.append(row)
            print({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()},
                  flush=True)  # fmt: skip
    write_results(args.out, "causal_attention", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
