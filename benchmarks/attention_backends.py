"""Forward+backward speed of each ``attn_impl`` for a model config: whole model and attention alone.

    python benchmarks/attention_backends.py yamls/pretrain/mpt-1b.yaml yamls/pretrain/llama-1b.yaml \
        --impls sdpa flash cudnn torch --microbatch 2 --out results/

For each config and backend it times (CUDA events, after warm-up) one training microbatch of the
whole model, fwd+bwd in amp_bf16 (no optimizer step), and reports model TFLOP/s and MFU by
LLM Foundry's formula (``model.flops_per_batch``: attention counted over the full square). It
then times the attention kernel alone on the same shapes, fwd+bwd, with FLOPs counted the same
way (``4 * batch * heads * seq^2 * head_dim`` forward, times 3). A backend that cannot run the
config is reported with its error instead of a number.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys

import torch
from bench_utils import cuda_time_ms, model_from_yaml, random_batch, write_results

from foundry.callbacks.device_flops import device_peak_flops_per_sec
from foundry.models.attention import ATTENTION_IMPLS, AttentionInputs


def impl_override(config_path: str, impl: str) -> str:
    """The override that selects ``impl``: Llama keeps attn_impl at the top of its model section."""
    return f"model.attn_impl={impl}" if "llama" in config_path else f"model.attn_config.attn_impl={impl}"


def time_model(config_path: str, impl: str, microbatch: int, warmup: int, iters: int) -> dict:
    overrides = [impl_override(config_path, impl), "model.init_device=cuda"]
    model, seq_len = model_from_yaml(config_path, overrides)
    batch = random_batch(microbatch, seq_len, model.config.vocab_size, torch.device("cuda"))

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    step_ms = statistics.median(cuda_time_ms(step, warmup, iters))
    flops = model.flops_per_batch(batch)
    peak = device_peak_flops_per_sec(torch.device("cuda"), "amp_bf16")
    return {
        "step_ms": step_ms,
        "tokens_per_s": microbatch * seq_len / step_ms * 1e3,
        "model_tflops": flops / step_ms / 1e9,
        "mfu": flops / step_ms * 1e3 / peak if peak else float("nan"),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "_shape": (model.config.n_heads, model.config.attn_config.resolve_kv_n_heads(model.config.n_heads),
                   model.config.head_dim, seq_len),
    }  # fmt: skip


def time_attention(impl: str, shape: tuple[int, int, int, int], microbatch: int, warmup: int, iters: int) -> dict:
    n_heads, kv_heads, head_dim, seq_len = shape
    make = lambda heads: torch.randn(  # noqa: E731
        microbatch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    q, k, v = make(n_heads), make(kv_heads), make(kv_heads)
    attention, inputs, scale = ATTENTION_IMPLS[impl], AttentionInputs(), 1 / math.sqrt(head_dim)
    grad = torch.randn(microbatch, n_heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        attention(q, k, v, inputs, scale, 0.0).backward(grad)

    step_ms = statistics.median(cuda_time_ms(step, warmup, iters))
    flops = 3 * 4 * microbatch * n_heads * seq_len**2 * head_dim
    return {"attn_ms": step_ms, "attn_tflops": flops / step_ms / 1e9}


def time_packed_attention(impl: str, shape: tuple[int, ...], microbatch: int, warmup: int, iters: int) -> dict:
    """``time_attention`` with q, k, v as the model makes them: strided views of one (batch, seq, qkv) tensor.

    The difference to ``attn_ms`` is what the layout costs: the kernels read strided heads, and the
    backward concatenates dq, dk and dv into the projection's gradient.
    """
    n_heads, kv_heads, head_dim, seq_len = shape
    widths = [n_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(microbatch, seq_len, sum(widths), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attention, inputs, scale = ATTENTION_IMPLS[impl], AttentionInputs(), 1 / math.sqrt(head_dim)
    grad = torch.randn(microbatch, n_heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        q, k, v = (part.unflatten(-1, (-1, head_dim)).transpose(1, 2) for part in qkv.split(widths, dim=-1))
        attention(q, k, v, inputs, scale, 0.0).backward(grad)

    step_ms = statistics.median(cuda_time_ms(step, warmup, iters))
    return {"packed_attn_ms": step_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="train YAMLs whose model section is benchmarked")
    parser.add_argument("--impls", nargs="+", default=["sdpa", "flash", "cudnn", "torch"])
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="folder for attention_backends.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_backends.py needs a CUDA device.", file=sys.stderr)
        return 2
    rows = []
    for config_path in args.configs:
        for impl in args.impls:
            row = {"config": config_path.rsplit("/", 1)[-1], "attn_impl": impl, "microbatch": args.microbatch}
            try:
                result = time_model(config_path, impl, args.microbatch, args.warmup, args.iters)
                shape = result.pop("_shape")
                row.update(result)
                row.update(time_attention(impl, shape, args.microbatch, args.warmup, args.iters))
                row.update(time_packed_attention(impl, shape, args.microbatch, args.warmup, args.iters))
            except Exception as error:  # a backend that cannot run is a result, not a crash
                row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
            rows.append(row)
            print(row, flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    write_results(args.out, "attention_backends", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
