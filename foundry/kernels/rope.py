"""Rotary position embedding, forward and backward, in the half-split (GPT-NeoX / HF ``rotate_half``) layout.

The layout of ``foundry.models.layers.apply_rope``, which both ``rope_impl`` values (``dail``, ``hf``)
use. One program rotates all heads of one token: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
on the two halves of each head. The backward is the same rotation by the opposite angle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundry.errors import FoundryError
from foundry.kernels.device import lazy_jit, num_warps_for, require_kernels


@lazy_jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, y_ptr, seq_len, n_heads, half_dim,
    x_batch_stride, x_seq_stride, x_head_stride, cos_batch_stride, cos_seq_stride, y_token_stride, y_head_stride,
    SIN_SIGN: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    batch, position = token // seq_len, token % seq_len
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half_dim)
    angle_offset = batch * cos_batch_stride + position * cos_seq_stride + dims
    cos = tl.load(cos_ptr + angle_offset, mask=dims < half_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + angle_offset, mask=dims < half_dim, other=0.0).to(tl.float32) * SIN_SIGN
    x_first = x_ptr + batch * x_batch_stride + position * x_seq_stride + heads * x_head_stride + dims
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + half_dim, mask=mask, other=0.0).to(tl.float32)
    y_first = y_ptr + token * y_token_stride + heads * y_head_stride + dims
    tl.store(y_first, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_first + half_dim, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sin_sign: int) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim), last dim contiguous -> a new contiguous tensor, rotated."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, seq_len, n_heads, head_dim = x.shape
    y = torch.empty((batch, seq_len, n_heads, head_dim), dtype=x.dtype, device=x.device)
    block_heads, block_half = triton.next_power_of_2(n_heads), triton.next_power_of_2(head_dim // 2)
    cos_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    _rope[(batch * seq_len,)](
        x, cos, sin, y, seq_len, n_heads, head_dim // 2, x.stride(0), x.stride(1), x.stride(2),
        cos_batch_stride, cos.stride(1), y.stride(1), y.stride(2), SIN_SIGN=sin_sign,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=num_warps_for(block_heads * block_half, x.device),
    )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, -1), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` as a Triton kernel: x (batch, seq, heads, head_dim); cos, sin (batch or 1, seq, 1, head_dim).

    cos and sin carry each angle twice (both halves), as ``rope_cos_sin`` builds them; the kernel reads
    the first half. Computed in fp32, returned in x's dtype.
    """
    require_kernels(x, "rope")
    if x.dim() != 4 or cos.dim() != 4 or cos.shape[1] != x.shape[1] or cos.shape[-1] != x.shape[-1]:
        raise FoundryError(
            f"The Triton rope kernel takes x (batch, seq, heads, head_dim) and cos/sin (batch or 1, seq, 1, "
            f"head_dim) in the half-split layout of apply_rope; got x {tuple(x.shape)}, cos {tuple(cos.shape)}."
        )
    cos, sin = cos.contiguous(), sin.contiguous()
    return _Rope.apply(x, cos, sin)
