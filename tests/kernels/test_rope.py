from __future__ import annotations

import pytest
import torch

from foundry.errors import FoundryError
from foundry.kernels.rope import rope
from foundry.models.layers import apply_rope, rope_cos_sin, rope_inv_freq


def _qkv_query(
    batch: int, seq: int, heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q as the attention layer sees it: a strided view into the fused qkv projection."""
    qkv = torch.randn(batch, seq, 3 * heads * head_dim).to(dtype).requires_grad_()
    return qkv, qkv[..., : heads * head_dim].reshape(batch, seq, heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "seq", "heads", "head_dim"), [(2, 7, 3, 10), (1, 16, 4, 16), (3, 5, 1, 6)])
def test_rope_matches_apply_rope(
    batch: int, seq: int, heads: int, head_dim: int, dtype: torch.dtype, assert_close
) -> None:
    qkv, q = _qkv_query(batch, seq, heads, head_dim, dtype)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], rope_inv_freq(head_dim, 10000.0))
    expected, actual = apply_rope(q, cos, sin), rope(q, cos, sin)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    upstream = torch.randn(expected.shape).to(dtype)
    assert_close(torch.autograd.grad(actual, qkv, upstream)[0], torch.autograd.grad(expected, qkv, upstream)[0], dtype)


def test_rope_uses_per_row_positions(assert_close) -> None:
    """Left-padded batches (rope_impl: hf) give each row its own positions: cos/sin (batch, seq, 1, head_dim)."""
    _, q = _qkv_query(2, 6, 2, 8, torch.float32)
    positions = (torch.arange(6)[None] - torch.tensor([[0], [3]])).clamp(min=0)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(8, 500000.0))
    assert_close(rope(q, cos, sin), apply_rope(q, cos, sin), torch.float32)


def test_rope_refuses_a_layout_it_does_not_implement() -> None:
    x = torch.randn(2, 4, 8)
    cos, sin = rope_cos_sin(torch.arange(4)[None], rope_inv_freq(8, 10000.0))
    with pytest.raises(FoundryError, match=r"\(batch, seq, heads, head_dim\)"):
        rope(x, cos, sin)
