"""fp32 math standing in for the FlashAttention-4 package's two entry points, so its ops run on CPU tensors.

Same signatures and layouts as ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``:
q (batch, seq, heads, head_dim), k and v (batch, keys, kv_heads, head_dim), the causal mask aligned to
the last key where keys outnumber queries (query i sees keys up to keys - seq + i). Grouped-query heads
are served by broadcasting, never by repeating k and v, so a test can tell whether its caller repeats them.
"""

from __future__ import annotations

import types

import torch


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq, heads, dim), (batch, keys, kv_heads, dim) -> fp32 (batch, kv_heads, group, seq, dim) and
    (batch, kv_heads, 1, keys, dim): kv head g serves query heads g*group .. g*group+group-1."""
    q = q.float().transpose(1, 2).unflatten(1, (k.shape[2], -1))
    return q, k.float().transpose(1, 2)[:, :, None]


def _end_aligned_causal(queries: int, keys: int) -> torch.Tensor:
    return torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """Output (batch, seq, heads, dim) and log-sum-exp (batch, heads, seq) of causal attention, in fp32."""
    grouped_q, grouped_k = _grouped(q, k)
    scores = (grouped_q @ grouped_k.transpose(-2, -1)) * scale  # (batch, kv_heads, group, seq, keys)
    scores = scores.masked_fill(~_end_aligned_causal(q.shape[1], k.shape[1]), float("-inf"))
    out = scores.softmax(-1) @ v.float().transpose(1, 2)[:, :, None]
    return out.flatten(1, 2).transpose(1, 2), scores.logsumexp(-1).flatten(1, 2)


def reference_fwd(q, k, v, *, softmax_scale, causal, out, lse, return_lse):
    assert causal and return_lse
    assert out.is_contiguous() and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    expected_out, expected_lse = math_attention(q, k, v, softmax_scale)
    out.copy_(expected_out)
    lse.copy_(expected_lse)
    return out, lse, None, None, None


def reference_bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, dq, dk, dv):
    """The attention backward written out (an op's body runs below autograd): dS = P * (dP - rowsum(dO * O))."""
    assert causal and dout.is_contiguous()
    assert all(grad.is_contiguous() and grad.shape == x.shape for grad, x in ((dq, q), (dk, k), (dv, v)))
    grouped_q, grouped_k = _grouped(q, k)  # (batch, kv_heads, group, seq, dim), (batch, kv_heads, 1, keys, dim)
    grouped_out, grouped_dout = (_grouped(x, k)[0] for x in (out, dout))
    grouped_v = v.float().transpose(1, 2)[:, :, None]
    lse = lse.unflatten(1, (k.shape[2], -1))[..., None]  # (batch, kv_heads, group, seq, 1)
    causal_mask = _end_aligned_causal(q.shape[1], k.shape[1])
    probs = torch.exp((grouped_q @ grouped_k.transpose(-2, -1)) * softmax_scale - lse) * causal_mask
    row_dot = (grouped_dout * grouped_out).sum(-1, keepdim=True)
    grad_scores = probs * (grouped_dout @ grouped_v.transpose(-2, -1) - row_dot)
    # each kv head sums the gradients of the query heads it serves (the group dimension)
    dq.copy_((grad_scores @ grouped_k * softmax_scale).flatten(1, 2).transpose(1, 2))
    dk.copy_((grad_scores.transpose(-2, -1) @ grouped_q * softmax_scale).sum(2).transpose(1, 2))
    dv.copy_((probs.transpose(-2, -1) @ grouped_dout).sum(2).transpose(1, 2))
    return dq, dk, dv


def reference_interface(fwd=reference_fwd, bwd=reference_bwd) -> types.SimpleNamespace:
    """What ``flash_attention4._interface()`` returns, with these entry points."""
    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)
