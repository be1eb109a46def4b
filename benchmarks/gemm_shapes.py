"""TFLOP/s of every GEMM one training step of a model config runs, under each BLAS library torch offers.

    python benchmarks/gemm_shapes.py yamls/pretrain/mpt-125m.yaml --microbatch 96 --blas cublas cublaslt --out OUT
    CUBLASLT_WORKSPACE_SIZE=65536 python benchmarks/gemm_shapes.py ...   # workspace settings: env, per process

For each distinct ``nn.Linear`` shape of the model (an untied LM head among them, at the whole
microbatch's rows: the unfused loss) and the LM head in the rows of one fused-loss chunk, it times in bf16
the three GEMMs training runs: the forward ``x @ W.T + b`` (``F.linear``), the input gradient ``dy @ W``
and the weight gradient ``dy.T @ x``; for the chunk also the weight gradient summed into fp32 inside the
GEMM, as the fused loss runs it (``wgrad_sum``). At the Llama-8B shape the fused loss's GEMMs were the
step's gap to torchtitan's (docs/PERFORMANCE.md "Against the peers"):

    python benchmarks/gemm_shapes.py yamls/pretrain/llama-8b.yaml --microbatch 4 --blas cublas --out OUT The rows say
which GEMMs of a step run below what the device's GEMMs reach, and whether a BLAS setting
(``torch.backends.cuda.preferred_blas_library``, cuBLAS workspace env vars) moves them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from bench_utils import cuda_time_ms, model_from_yaml, write_results
from torch import nn

from foundry.kernels.linear_cross_entropy import chunk_tokens_for
from foundry.kernels.weight_grad import add_weight_grad_


def linear_shapes(model: nn.Module) -> Counter[tuple[int, int, bool]]:
    """(in_features, out_features, has_bias) of each ``nn.Linear``, with how many layers have it."""
    return Counter(
        (module.in_features, module.out_features, module.bias is not None)
        for module in model.modules()
        if isinstance(module, nn.Linear)
    )


def time_gemms(
    tokens: int, in_features: int, out_features: int, bias: bool, warmup: int, iters: int, fp32_sum: bool = False
) -> dict:
    """Median milliseconds and TFLOP/s of the forward, input-gradient and weight-gradient GEMMs; with
    ``fp32_sum`` also the weight gradient added into an fp32 sum inside the GEMM, as the fused loss does
    (``wgrad_sum``)."""
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x, weight, dy = make(tokens, in_features), make(out_features, in_features), make(tokens, out_features)
    b = make(out_features) if bias else None
    flops = 2 * tokens * in_features * out_features
    gemms = {"fwd": lambda: F.linear(x, weight, b), "dgrad": lambda: dy @ weight, "wgrad": lambda: dy.t() @ x}
    if fp32_sum:
        grad_sum = torch.zeros(out_features, in_features, device="cuda", dtype=torch.float32)
        gemms["wgrad_sum"] = lambda: add_weight_grad_(grad_sum, dy, x)
    row = {}
    for name, gemm in gemms.items():
        ms = statistics.median(cuda_time_ms(gemm, warmup, iters))
        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="train YAML whose model section is measured")
    parser.add_argument("--microbatch", type=int, required=True, help="sequences per microbatch")
    parser.add_argument("--blas", nargs="+", default=["cublas", "cublaslt"], help="preferred_blas_library values")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for gemm_shapes.json")
    parser.add_argument("--tag", default="", help="a label for this process's settings (e.g. its env vars)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_shapes.py needs a CUDA device.", file=sys.stderr)
        return 2
    model, seq_len = model_from_yaml(args.config, ["model.init_device=meta"])
    tokens = args.microbatch * seq_len
    shapes = [(tokens, *shape, count, False) for shape, count in linear_shapes(model).items()]
    vocab, d_model = model.config.vocab_size, model.config.d_model
    chunk_rows = chunk_tokens_for(tokens, vocab, element_size=2)
    shapes.append((chunk_rows, d_model, vocab, False, tokens // chunk_rows, True))  # the fused loss's LM head
    env = {key: os.environ[key] for key in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE") if key in os.environ}
    rows = []
    for blas in args.blas:
        torch.backends.cuda.preferred_blas_library(blas)
        total_ms = 0.0
        for rows_, in_features, out_features, bias, count, fused_loss in shapes:
            row = {"tag": args.tag or str(env or "default"), "blas": blas, "m": rows_, "in": in_features,
                   "out": out_features, "bias": bias, "per_step": count, "fused_loss_chunk": fused_loss}  # fmt: skip
            row.update(time_gemms(rows_, in_features, out_features, bias, args.warmup, args.iters, fused_loss))
            total_ms += count * (row["fwd_ms"] + row["dgrad_ms"] + row["wgrad_ms"])
            rows.append(row)
            print(row, flush=True)
        rows.append({"tag": args.tag or str(env or "default"), "blas": blas, "microbatch_gemm_ms": total_ms})
    write_results(args.out, f"gemm_shapes{'_' + args.tag if args.tag else ''}", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
