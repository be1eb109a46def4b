"""The fused loss's per-chunk steps on one GPU: the cross-entropy kernel, and the weight-gradient sum.

The kernel is bound by memory traffic: it reads each row twice and writes it once. For each warp
count: time (``triton.testing.do_bench``), bandwidth counted as the unavoidable one read plus one
write of the chunk, and the largest difference from the PyTorch path. Chunks are the ones
``linear_cross_entropy`` makes in bf16: 8,192 x 50,368 (MPT) and 4,096 x 128,256 (Llama 3).

Then the chunk's share of the fp32 weight gradient, ``grad_weight += dlogits.T @ hidden``, two ways:
a bf16 GEMM and an fp32 add, or one GEMM that accumulates into the fp32 sum (``add_weight_grad_``).

    python benchmarks/cross_entropy_launch.py --out OUT
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.testing
from bench_utils import write_results

from foundry.kernels.cross_entropy import cross_entropy_rows_
from foundry.kernels.linear_cross_entropy import _cross_entropy_rows_torch_
from foundry.kernels.weight_grad import add_weight_grad_

CHUNKS = ((8192, 50368), (4096, 128256))
D_MODEL = {50368: 768, 128256: 2048}  # MPT-125M's and Llama-1B's
WARPS = (4, 8, 16, 32)


def launch_row(rows: int, vocab: int, warps: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=generator) * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    targets[::7] = -100
    inv_count = 1.0 / (targets != -100).sum().float()
    expected = logits.clone()
    expected_loss = _cross_entropy_rows_torch_(expected, targets, inv_count, 1.0, -100)
    got = logits.clone()
    loss = cross_entropy_rows_(got, targets, inv_count, 1.0, -100, warps)
    error = max((loss - expected_loss).abs().max().item(), (got.float() - expected.float()).abs().max().item())
    ms = triton.testing.do_bench(lambda: cross_entropy_rows_(logits, targets, inv_count, 1.0, -100, warps))
    traffic = 2 * logits.numel() * logits.element_size()
    return {
        "chunk": f"{rows}x{vocab}",
        "warps": warps,
        "ms": round(ms, 3),
        "read_write_gb_per_s": round(traffic / ms / 1e6),
        "max_abs_error": error,
    }


def accumulation_row(rows: int, vocab: int) -> dict:
    dlogits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(rows, D_MODEL[vocab], device="cuda", dtype=torch.bfloat16)
    grad_weight = torch.zeros(vocab, D_MODEL[vocab], device="cuda")

    def add_bf16_product() -> None:
        grad_weight.add_(dlogits.T @ hidden)

    return {
        "chunk": f"{rows}x{vocab}, d_model {D_MODEL[vocab]}",
        "bf16_gemm_then_fp32_add_ms": round(triton.testing.do_bench(add_bf16_product), 3),
        "fp32_accumulating_gemm_ms": round(
            triton.testing.do_bench(lambda: add_weight_grad_(grad_weight, dlogits, hidden)), 3
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cross_entropy_launch.py needs a CUDA device.", file=sys.stderr)
        return 2
    results = []
    for rows, vocab in CHUNKS:
        for warps in WARPS:
            results.append(launch_row(rows, vocab, warps))
            print(results[-1], flush=True)
    for rows, vocab in CHUNKS:
        results.append(accumulation_row(rows, vocab))
        print(results[-1], flush=True)
    write_results(args.out, "cross_entropy_launch", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
