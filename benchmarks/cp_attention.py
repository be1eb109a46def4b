"""Context parallelism's attention on one GPU: a CP2 rank's share of one 64k-token Llama-3.1-8B layer, by kernel.

    python benchmarks/cp_attention.py --out OUT_DIR

With two context-parallel ranks and head-tail load balancing, rank 0 holds the sequence's first and last
quarter: its 16,384 head queries attend to the first 16,384 keys (plain causal) and its 16,384 tail queries
to all 65,536 keys (causal aligned to the last key); rank 1's quarters cost the same. Every variant runs
that work, forward + backward in bf16 (32 query heads, 8 key/value heads, head_dim 128):

- ``foundry``: what ``ContextParallel.split_sequence_attention`` runs on the gathered keys and values
  (``foundry.distributed.context_parallel._sdpa_prefix_attention``) with ``context_parallel_attention:
  end_aligned``: the head through SDPA with grouped heads, the tail through FlashAttention-2's op (the one SDPA
  kernel that aligns a causal mask to the last key) on heads repeated to 32.
- ``foundry-split``: the same with ``split`` (what ``auto``, the default, runs on a GPU with cuDNN;
  ``foundry.distributed.split_attention``: the tail's two pieces on cuDNN, merged, with their backward).
- ``flash2-split``, ``cudnn-split``: the same work in pieces a square-causal kernel runs: the head (causal),
  and the tail as a full block over the first 49,152 keys plus a causal square over the last 16,384, each
  piece on SDPA pinned to one backend (cuDNN on heads repeated to 32, as it takes equal head counts). The
  two tail pieces would be merged by their log-sum-exp (an elementwise pass over the tail's output, not
  timed); ``merge_error`` checks that merge on the forward against ``foundry``'s output.

FLOPs are the work done (the causal half skipped), backward counted as 2.5 forwards (five matmuls to
two), so TFLOP/s is each kernel's real rate; ``layer_ms`` × 32 layers is one microbatch's attention.

``gradient_layouts`` (small shapes): each SDPA kernel's dq, dk, dv against fp32 math when the output's
gradient is dense, or a slice of a larger gradient (two sequences of a batch, or heads of a (batch, heads,
seq, dim) gradient), as ``torch.cat``'s backward hands CP's first chunk one: SDPA alone, and through
foundry's chunk path, which copies such a gradient into the output's layout first.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_utils import cuda_time_ms, markdown_table, write_results
from torch.nn.attention import SDPBackend, sdpa_kernel

from foundry.distributed.context_parallel import _sdpa_prefix_attention

HEADS, KV_HEADS, HEAD_DIM, SEQ, CHUNK = 32, 8, 128, 65536, 16384
SCALE = HEAD_DIM**-0.5
BACKENDS = {"flash2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

Piece = tuple[str, int, int, bool]  # (name, queries, keys, causal square: else a full block before the queries)
FOUNDRY_PIECES: list[Piece] = [("head", CHUNK, CHUNK, True), ("tail", CHUNK, SEQ, True)]
SPLIT_PIECES: list[Piece] = [
    ("head", CHUNK, CHUNK, True),
    ("tail-before", CHUNK, SEQ - CHUNK, False),
    ("tail-diagonal", CHUNK, CHUNK, True),
]


def piece_flops(queries: int, keys: int, causal: bool, end_aligned: bool = False) -> float:
    """Forward + backward FLOPs of the work done: QK^T and PV over the scores the mask keeps."""
    scores = queries * keys
    if causal:
        scores = queries * (keys - queries) + queries * queries / 2 if end_aligned else queries * queries / 2
    return 4 * scores * HEADS * HEAD_DIM * 3.5


def inputs(queries: int, keys: int) -> tuple[torch.Tensor, ...]:
    """q (1, queries, heads, dim) and k, v (1, keys, kv_heads, dim), the models' layout, bf16 leaves."""
    make = lambda n, h: torch.randn(1, n, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    return make(queries, HEADS), make(keys, KV_HEADS), make(keys, KV_HEADS)


def foundry_piece(queries: int, keys: int, split: bool = False) -> Callable[[], torch.Tensor]:
    q, k, v = inputs(queries, keys)
    return lambda: _sdpa_prefix_attention(q, k, v, SCALE, 0.0, attention="split" if split else "end_aligned")


def pinned_piece(backend: SDPBackend, queries: int, keys: int, causal: bool) -> Callable[[], torch.Tensor]:
    q, k, v = inputs(queries, keys)

    def run() -> torch.Tensor:
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        grouped = True
        if backend == SDPBackend.CUDNN_ATTENTION:
            kh, vh = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (kh, vh))
            grouped = False
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=SCALE, enable_gqa=grouped)
        return out.transpose(1, 2)

    return run


def time_piece(run: Callable[[], torch.Tensor], warmup: int, iters: int) -> float:
    out = run()
    grad = torch.randn_like(out)

    def step() -> None:
        run().backward(grad)

    times = cuda_time_ms(step, warmup, iters)
    return sorted(times)[len(times) // 2]


def kernel_names(run: Callable[[], torch.Tensor]) -> list[str]:
    """The attention kernels one forward + backward launches (which backend SDPA picked)."""
    out = run()
    grad = torch.randn_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run().backward(grad)
        torch.cuda.synchronize()
    names = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    keys = ("flash", "fmha", "cudnn", "attention", "sm90", "xmma")
    return sorted(name[:90] for name in names if any(key in name.lower() for key in keys))


def split_error() -> float:
    """Max |foundry's split tail - its end-aligned tail| on one forward (bf16)."""
    q, k, v = inputs(CHUNK, SEQ)
    with torch.no_grad():
        one_call = _sdpa_prefix_attention(q, k, v, SCALE, 0.0, attention="end_aligned").float()
        return (_sdpa_prefix_attention(q, k, v, SCALE, 0.0, attention="split").float() - one_call).abs().max().item()


def merge_error() -> float:
    """Max |tail merged from its two pieces by log-sum-exp - foundry's tail| on one forward (flash op, bf16)."""
    q, k, v = inputs(CHUNK, SEQ)
    expected = _sdpa_prefix_attention(q, k, v, SCALE, 0.0).float()
    qh, kh, vh = (x.detach().transpose(1, 2) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (kh, vh))
    before = SEQ - CHUNK
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    out_a, lse_a = flash(qh, kh[:, :, :before], vh[:, :, :before], 0.0, False, scale=SCALE)[:2]
    out_b, lse_b = flash(qh, kh[:, :, before:], vh[:, :, before:], 0.0, True, scale=SCALE)[:2]
    lse = torch.logaddexp(lse_a, lse_b)
    merged = out_a.float() * (lse_a - lse).exp().unsqueeze(-1) + out_b.float() * (lse_b - lse).exp().unsqueeze(-1)
    return (merged.transpose(1, 2) - expected).abs().max().item()


def gradient_layout_errors() -> dict[str, list[float]]:
    """Relative error of (dq, dk, dv) by kernel and output-gradient layout, SDPA alone and foundry's chunk path."""
    generator = torch.Generator().manual_seed(0)
    batch, chunk, heads, dim = 2, 512, 8, 64
    inputs = [torch.randn(batch, chunk, heads, dim, generator=generator) for _ in range(3)]  # (batch, seq, heads, dim)
    grads = {
        "dense": torch.randn(batch, chunk, heads, dim, generator=generator),
        "batch_sliced": torch.randn(batch, 2 * chunk, heads, dim, generator=generator)[:, :chunk],
        "head_sliced": torch.randn(batch, heads, 2 * chunk, dim, generator=generator)[:, :, :chunk].transpose(1, 2),
    }

    def gradients(backend: SDPBackend, grad: torch.Tensor, dtype: torch.dtype, foundry: bool) -> list[torch.Tensor]:
        leaves = [x.to("cuda", dtype, copy=True).requires_grad_() for x in inputs]
        with sdpa_kernel(backend):
            if foundry:
                out = _sdpa_prefix_attention(*leaves, dim**-0.5, 0.0)
            else:
                out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=True)
                out = out.transpose(1, 2)
            out.backward(grad.to("cuda", dtype))
        return [x.grad.double() for x in leaves]

    errors = {}
    for layout, grad in grads.items():
        exact = gradients(SDPBackend.MATH, grad.contiguous(), torch.float32, False)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
            for path in ("sdpa", "foundry"):
                try:
                    got = gradients(backend, grad, torch.bfloat16, path == "foundry")
                    errors[f"{name}/{path}/{layout}"] = [((g - e).norm() / e.norm()).item() for g, e in zip(got, exact)]
                except RuntimeError as error:  # a kernel that cannot run these inputs
                    errors[f"{name}/{path}/{layout}"] = [f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"]
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants: dict[str, list[tuple[Piece, Callable[[], Callable[[], torch.Tensor]]]]] = {
        "foundry": [(piece, lambda p=piece: foundry_piece(p[1], p[2])) for piece in FOUNDRY_PIECES],
        "foundry-split": [(piece, lambda p=piece: foundry_piece(p[1], p[2], True)) for piece in FOUNDRY_PIECES],
        **{
            f"{name}-split": [
                (piece, lambda p=piece, b=backend: pinned_piece(b, p[1], p[2], p[3])) for piece in SPLIT_PIECES
            ]
            for name, backend in BACKENDS.items()
        },
    }
    rows = []
    for variant, pieces in variants.items():
        for (name, queries, keys, causal), build in pieces:
            row = {"variant": variant, "piece": name, "queries": queries, "keys": keys, "causal": causal}
            try:
                run = build()
                ms = time_piece(run, args.warmup, args.iters)
                flops = piece_flops(queries, keys, causal, end_aligned=keys > queries and causal)
                row |= {"ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
                row["kernels"] = kernel_names(run) if name in ("head", "tail") else []
                if variant == "foundry-split" and name == "tail":
                    row["max_abs_vs_foundry"] = split_error()
                del run
            except Exception as error:  # a kernel that cannot run reports why
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                traceback.print_exc()
            rows.append(row)
            torch.cuda.empty_cache()
    for variant in variants:
        done = [row for row in rows if row["variant"] == variant and "ms" in row]
        if len(done) == len(variants[variant]):
            layer_ms = sum(row["ms"] for row in done)
            flops = sum(piece_flops(r["queries"], r["keys"], r["causal"], r["keys"] > r["queries"]) for r in done)
            rows.append({"variant": variant, "piece": "layer", "ms": round(layer_ms, 2),
                         "tflops": round(flops / layer_ms / 1e9, 1)})  # fmt: skip
    try:
        rows.append({"variant": "flash2-split", "piece": "merge_error", "max_abs": merge_error()})
    except Exception as error:
        rows.append({"variant": "flash2-split", "piece": "merge_error", "error": f"{type(error).__name__}: {error}"})
    layouts = gradient_layout_errors()
    rows.append({"variant": "sdpa", "piece": "gradient_layouts", "errors": layouts})
    print(
        markdown_table([{key: value for key, value in row.items() if key not in ("kernels", "errors")} for row in rows])
    )
    for case, errors in layouts.items():
        print(f"gradient layout {case}: dq, dk, dv relative errors {errors}")
    for row in rows:
        if row.get("kernels"):
            print(row["variant"], row["piece"], row["kernels"])
    write_results(args.out, "cp_attention", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
