"""Causal attention aligned to the last key, as kernel calls that only know square causal masks.

Under context parallelism a rank's later chunk of queries attends to every key up to its own end: more keys
than queries, with the causal mask aligned to the last key. Of SDPA's GPU kernels only FlashAttention-2 aligns
it so, and on Hopper its backward is slow; cuDNN's kernel is 1.66× faster on the same work (a CP2 rank's share
of a 64k-token Llama-8B layer, one H100: docs/PERFORMANCE.md "Long context") but masks from the first key. So
the chunk runs as two calls: a full (unmasked) block over the keys before the chunk, and a causal square over
the chunk's own keys. Their outputs merge by their log-sum-exps, as the kernels merge their own tiles:

    lse = log(exp(lse_a) + exp(lse_b)),   out = out_a · exp(lse_a - lse) + out_b · exp(lse_b - lse)

Backward calls each kernel's own backward with the merged output and log-sum-exp, which makes each piece's
softmax the whole row's: the exact gradient, with no grad through the log-sum-exp (torch's ring attention does
the same). Kernels (``KERNELS``): ``cudnn`` (CUDA, fp16/bf16, equal head counts), ``flash`` (CUDA
FlashAttention-2, the reference for the GPU test) and ``cpu`` (the CPU's flash kernel, for the tests here).

Forward and backward are custom ops (``foundry::end_aligned_attention_forward`` / ``_backward``), one call each
whatever the pieces: torch.compile traces them whole, and selective checkpointing (``keep_attention``) keeps
the forward's merged output and log-sum-exp, as it keeps one SDPA kernel's; it would keep every piece's output,
twice the tail chunk's, if it saw the kernels one by one (an 8B model at 64k then runs out of memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class SplitKernel:
    """One attention kernel's forward (returning the log-sum-exp) and backward (taking it), as aten ops.

    ``forward(q, k, v, causal, scale) -> (out, lse, state)``; ``backward(grad, q, k, v, out, lse, state,
    causal, scale) -> (dq, dk, dv)``. Tensors are (batch, heads, seq, head_dim); ``state`` is the tensors the
    kernel's backward needs beyond those (its RNG state); sequence lengths come from the shapes (dense inputs).
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cudnn_forward(q, k, v, causal, scale):  # type: ignore[no-untyped-def]
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, [seed, offset]


def _cudnn_backward(grad, q, k, v, out, lse, state, causal, scale):  # type: ignore[no-untyped-def]
    seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale
    )


def _flash_forward(q, k, v, causal, scale):  # type: ignore[no-untyped-def]
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, [seed, offset]


def _flash_backward(grad, q, k, v, out, lse, state, causal, scale):  # type: ignore[no-untyped-def]
    seed, offset = state
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
    )


def _cpu_forward(q, k, v, causal, scale):  # type: ignore[no-untyped-def]
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, []


def _cpu_backward(grad, q, k, v, out, lse, state, causal, scale):  # type: ignore[no-untyped-def]
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, scale=scale)


KERNELS = {
    "cudnn": SplitKernel(_cudnn_forward, _cudnn_backward),
    "flash": SplitKernel(_flash_forward, _flash_backward),
    "cpu": SplitKernel(_cpu_forward, _cpu_backward),
}


def split_kernel(q: torch.Tensor) -> str | None:
    """The kernel ``end_aligned_attention`` runs for ``q``: cuDNN on an NVIDIA GPU from Ampere on where SDPA may
    use it (fp16/bf16, head_dim a multiple of 8 up to 128), the CPU's flash kernel on a CPU; None where neither
    runs."""
    if q.is_cuda:
        head_dim = q.shape[-1]
        runs = q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128
        return "cudnn" if runs and _cudnn_attention_on(q.device.index) else None
    return "cpu" if q.device.type == "cpu" else None


@torch.compiler.assume_constant_result
def _cudnn_attention_on(device_index: int) -> bool:
    """Whether SDPA may run cuDNN's fused attention on this CUDA device. A constant to torch.compile: these
    queries return no tensor, and traced they would break every attention layer's graph in two."""
    # ROCm builds have no cuDNN; cuDNN's fused attention starts at Ampere (compute capability 8.0)
    if torch.version.hip is not None or torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    return torch.backends.cuda.cudnn_sdp_enabled()


def end_aligned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """Causal attention of q (batch, heads, queries, dim) over k, v (batch, heads, keys, dim), keys ≥ queries,
    query i seeing keys up to ``keys - queries + i``; equal head counts. Returns (batch, heads, queries, dim)."""
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"end_aligned_attention needs at least as many keys as queries: {k.shape[2]} < {q.shape[2]}")
    return torch.ops.foundry.end_aligned_attention_forward(q, k, v, scale, kernel)[0]


def in_layout(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``tensor``, or a copy of it laid out with ``strides`` where its own differ (a size-1 dimension's stride
    is never read, so it may differ)."""
    if all(size == 1 or own == wanted for size, own, wanted in zip(tensor.shape, tensor.stride(), strides)):
        return tensor
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _pieces(queries: int, keys: int) -> list[tuple[slice, bool]]:
    """(keys, causal) of each kernel call: the keys before the chunk unmasked, then the chunk's own causally."""
    before = keys - queries
    return [(slice(before, None), True)] if before == 0 else [(slice(0, before), False), (slice(before, None), True)]


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The merged output (the kernel's layout), its log-sum-exp, and every piece's kernel state, in order."""
    outs, lses, states = [], [], []
    for keys, causal in _pieces(q.shape[2], k.shape[2]):
        out, lse, state = KERNELS[kernel].forward(q, k[:, :, keys], v[:, :, keys], causal, scale)
        outs.append(out)
        lses.append(lse)
        states += state
    out, lse = _merge(outs, lses)
    return out, lse, states


def _backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    states: list[torch.Tensor],
    scale: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: each piece's kernel backward with the merged output and log-sum-exp, summed over pieces."""
    grad = in_layout(grad, out.stride())  # the kernels read the output and its gradient in one layout
    pieces = _pieces(q.shape[2], k.shape[2])
    per_piece = len(states) // len(pieces)
    # each piece's key/value gradients go into place as they come: one piece's at a time besides the whole
    dq, dk, dv = None, torch.empty_like(k), torch.empty_like(v)
    for index, (keys, causal) in enumerate(pieces):
        state = states[index * per_piece : (index + 1) * per_piece]
        piece_dq, piece_dk, piece_dv = KERNELS[kernel].backward(
            grad, q, k[:, :, keys], v[:, :, keys], out, lse, state, causal, scale
        )
        dq = piece_dq if dq is None else dq.add_(piece_dq)
        dk[:, :, keys].copy_(piece_dk)
        dv[:, :, keys].copy_(piece_dv)
        del piece_dk, piece_dv
    return dq, dk, dv


# No device_types: one implementation calls whichever aten kernel ``kernel`` names, on any device. The aten
# kernels have fake implementations, so the same code run on fake tensors gives torch.compile the outputs' metadata.
_forward_op = torch.library.custom_op("foundry::end_aligned_attention_forward", _forward, mutates_args=())
_forward_op.register_fake(_forward)
_backward_op = torch.library.custom_op("foundry::end_aligned_attention_backward", _backward, mutates_args=())
_backward_op.register_fake(_backward)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, kernel = inputs
    out, lse, states = output
    ctx.save_for_backward(q, k, v, out, lse, *states)
    ctx.scale, ctx.kernel = scale, kernel


def _autograd_backward(ctx, grad_out, grad_lse, grad_states):  # type: ignore[no-untyped-def]
    q, k, v, out, lse, *states = ctx.saved_tensors
    dq, dk, dv = torch.ops.foundry.end_aligned_attention_backward(
        grad_out, q, k, v, out, lse, states, ctx.scale, ctx.kernel
    )
    return dq, dk, dv, None, None


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces' outputs (batch, heads, queries, dim) weighted by their share of the row's softmax mass. The
    merged output and log-sum-exp keep the layouts the kernel gave the pieces (its backward reads its own)."""
    if len(outs) == 1:
        return outs[0], lses[0]
    rows = outs[0].shape[:-1]  # (batch, heads, queries); a kernel may keep a trailing 1 on its log-sum-exp
    dtype = torch.promote_types(outs[0].dtype, torch.float32)  # bf16 pieces merge in fp32, fp64 ones in fp64
    lse_a, lse_b = (lse.reshape(rows).to(dtype) for lse in lses)
    lse = torch.logaddexp(lse_a, lse_b)
    # one buffer of the merge's precision (the first piece's copy, or the piece itself where already in it)
    out = outs[0].to(dtype).mul_((lse_a - lse).exp().unsqueeze(-1))
    out.addcmul_(outs[1], (lse_b - lse).exp().unsqueeze(-1))
    # the merged output in the layout the kernel gave its own (its backward expects out and grad alike)
    merged = torch.empty_like(outs[1]).copy_(out)
    return merged, lse.reshape(lses[1].shape).to(lses[1].dtype)
