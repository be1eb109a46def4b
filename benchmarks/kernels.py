"""foundry's Triton kernels vs their eager PyTorch layers on training shapes (one GPU).

For each kernel: the largest error of the fused and of the eager path against an fp32 reference,
forward+backward time (``triton.testing.do_bench``), and for the fused linear + cross-entropy the
peak memory of fused vs unfused at the same size. Shapes: 8 x 2048 tokens, d_model 2048,
vocabularies 50368 (MPT) and 128256 (Llama 3).

    python benchmarks/kernels.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing
from bench_utils import write_results

from foundry.kernels.glu import glu
from foundry.kernels.linear_cross_entropy import linear_cross_entropy
from foundry.kernels.norm import layer_norm, rms_norm
from foundry.kernels.rope import rope
from foundry.models.layers import apply_rope, rope_cos_sin, rope_inv_freq

TOKENS, D_MODEL, HEADS, FFN_HIDDEN = 8 * 2048, 2048, 16, 8192


def _fwd_bwd_ms(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> float:
    def step() -> None:
        out = fn()
        grad = torch.ones_like(out) if out.dim() else None
        torch.autograd.grad(out, inputs, grad)

    return triton.testing.do_bench(step, warmup=10, rep=60)


def _max_error(
    fn: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], inputs: list[torch.Tensor]
) -> float:
    """Largest |fused - fp32 reference| over the output and every input gradient, relative to the reference's scale."""
    worst = 0.0
    out, ref = fn(), reference()
    upstream = torch.randn_like(ref) if ref.dim() else None
    pairs = [(out, ref)]
    pairs += zip(
        torch.autograd.grad(out, inputs, upstream.to(out.dtype) if upstream is not None else None),
        torch.autograd.grad(ref, inputs, upstream),
        strict=True,
    )
    for got, want in pairs:
        worst = max(
            worst, ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()
        )
    return worst


def _row(name: str, shape: str, dtype: torch.dtype, fused, eager, reference, inputs) -> dict:
    fused_ms, eager_ms = _fwd_bwd_ms(fused, inputs), _fwd_bwd_ms(eager, inputs)
    return {
        "kernel": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
        "fused_rel_err": _max_error(fused, reference, inputs), "eager_rel_err": _max_error(eager, reference, inputs),
        "fused_ms": fused_ms, "eager_ms": eager_ms, "speedup": eager_ms / fused_ms,
    }  # fmt: skip


def norm_rows(dtype: torch.dtype) -> list[dict]:
    x = torch.randn(TOKENS, D_MODEL, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(D_MODEL, device="cuda", requires_grad=True)
    inputs = [x, weight]

    def rms_eager() -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight).to(dtype)

    def rms_reference() -> torch.Tensor:
        x32 = x.double()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()

    shape = f"{TOKENS}x{D_MODEL}"
    return [
        _row("rms_norm", shape, dtype, lambda: rms_norm(x, weight, 1e-5), rms_eager, rms_reference, inputs),
        _row("layer_norm (no bias)", shape, dtype, lambda: layer_norm(x, weight, None, 1e-5),
             lambda: F.layer_norm(x, (D_MODEL,), weight.to(dtype), None, 1e-5),
             lambda: F.layer_norm(x.double(), (D_MODEL,), weight.double(), None, 1e-5), inputs),
    ]  # fmt: skip


def rope_row(dtype: torch.dtype) -> dict:
    head_dim = D_MODEL // HEADS
    qkv = torch.randn(8, 2048, 3 * D_MODEL, device="cuda", dtype=dtype, requires_grad=True)
    q = lambda: qkv[..., :D_MODEL].reshape(8, 2048, HEADS, head_dim)  # noqa: E731 - a strided view, as in attention
    cos, sin = rope_cos_sin(torch.arange(2048, device="cuda")[None], rope_inv_freq(head_dim, 10000.0, "cuda"))
    return _row("rope (q from fused qkv)", f"8x2048x{HEADS}x{head_dim}", dtype, lambda: rope(q(), cos, sin),
                lambda: apply_rope(q(), cos, sin), lambda: apply_rope(q().double(), cos.double(), sin.double()),
                [qkv])  # fmt: skip


def glu_rows(dtype: torch.dtype) -> list[dict]:
    gate = torch.randn(TOKENS, FFN_HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    up = torch.randn(TOKENS, FFN_HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    shape = f"{TOKENS}x{FFN_HIDDEN}"
    return [
        _row("swiglu", shape, dtype, lambda: glu(gate, up, "silu"), lambda: F.silu(gate) * up,
             lambda: F.silu(gate.double()) * up.double(), [gate, up]),
        _row("geglu (tanh)", shape, dtype, lambda: glu(gate, up, "gelu", "tanh"),
             lambda: F.gelu(gate, approximate="tanh") * up,
             lambda: F.gelu(gate.double(), approximate="tanh") * up.double(), [gate, up]),
    ]  # fmt: skip


def _peak_mb(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - baseline) / 2**20


def cross_entropy_row(vocab: int) -> dict:
    hidden = (torch.randn(TOKENS, D_MODEL, device="cuda") * 0.5).requires_grad_()
    weight = (torch.randn(vocab, D_MODEL, device="cuda") * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (TOKENS,), device="cuda")
    targets[::7] = -100
    hidden_bf16 = hidden.detach().bfloat16().requires_grad_()  # as the final norm hands it over under autocast
    inputs = [hidden_bf16, weight]

    def fused() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear_cross_entropy(hidden_bf16, weight, targets)

    def eager() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = F.linear(hidden_bf16, weight)
        return F.cross_entropy(logits.float(), targets, ignore_index=-100)

    def reference() -> torch.Tensor:
        return F.cross_entropy(F.linear(hidden_bf16.float(), weight), targets, ignore_index=-100)

    row = _row("linear+cross_entropy (amp_bf16)", f"{TOKENS}x{D_MODEL} @ {vocab}", torch.bfloat16, fused, eager,
               reference, inputs)  # fmt: skip
    # fp32 end to end on a slice: the fused path must match the unfused loss to 1e-5.
    small = slice(0, 2048)
    fp32_loss = linear_cross_entropy(hidden[small], weight, targets[small])
    fp32_reference = F.cross_entropy(hidden[small] @ weight.T, targets[small], ignore_index=-100)
    row["fp32_loss_rel_err"] = ((fp32_loss - fp32_reference).abs() / fp32_reference.abs()).item()
    row["fused_peak_MiB"] = _peak_mb(lambda: torch.autograd.grad(fused(), inputs))
    row["eager_peak_MiB"] = _peak_mb(lambda: torch.autograd.grad(eager(), inputs))
    row["memory_ratio"] = row["eager_peak_MiB"] / row["fused_peak_MiB"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for kernels.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    for vocab in (50368, 128256):
        rows.append(cross_entropy_row(vocab))
        print(rows[-1], flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        rows += [*norm_rows(dtype), rope_row(dtype), *glu_rows(dtype)]
        print(rows[-5:], flush=True)
    write_results(args.out, "kernels", rows)


if __name__ == "__main__":
    main()
