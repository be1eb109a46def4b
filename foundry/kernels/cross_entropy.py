"""Cross-entropy over rows of logits that also writes d(loss)/d(logits) in place, as a Triton kernel.

The per-chunk step of ``linear_cross_entropy``: one program reads its row twice, once for the
online max and sum of exponentials (log-sum-exp), once to overwrite each logit with its gradient
``scale * (softmax - one_hot) / count``. No second (rows, vocab) tensor is ever allocated.

The kernel is bound by memory traffic (two reads and one write of the chunk). Two ways to save the
second read measured slower on an H100 (docs/PERFORMANCE.md): holding a whole row on chip (a
50,368-wide fp32 row spills registers) and a persistent grid that keeps few rows in flight so that
the second read hits L2 (too few loads in flight to keep HBM busy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundry.kernels.device import lazy_jit, num_warps_for

# A block of the vocabulary per loop step; rows of any length loop over it.
_MAX_VOCAB_BLOCK = 4096


@lazy_jit
def _cross_entropy_rows(
    logits_ptr, targets_ptr, row_loss_ptr, inv_count_ptr, inv_count_stride, row_stride, n_cols, ignore_index,
    logit_scale, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row).to(tl.int64)
    is_ignored = target == ignore_index
    running_max = float("-inf")
    exp_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * logit_scale
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        exp_sum = exp_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    log_sum_exp = running_max + tl.log(exp_sum)
    target_in_row = (target >= 0) & (target < n_cols)
    target_logit = tl.load(row_ptr + target, mask=target_in_row & ~is_ignored, other=0.0).to(tl.float32)
    tl.store(row_loss_ptr + row, tl.where(is_ignored, 0.0, log_sum_exp - target_logit * logit_scale))
    grad_scale = tl.where(is_ignored, 0.0, logit_scale * tl.load(inv_count_ptr + row * inv_count_stride))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
        grad = tl.exp(x - log_sum_exp) - tl.where(cols == target, 1.0, 0.0)
        tl.store(row_ptr + cols, (grad * grad_scale).to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_count: torch.Tensor,
    logit_scale: float,
    ignore_index: int,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Per-row losses (rows,) in fp32; ``logits`` (rows, vocab) is overwritten with d(mean loss)/d(logits).

    ``inv_count`` is 1 / (non-ignored targets in the whole batch), a device scalar, so chunks of one
    batch share the global denominator without a host sync; or one factor per row (rows,), each row's
    upstream gradient (per-token losses, ``linear_cross_entropy(reduction="none")``). ``num_warps`` overrides
    the launch's warps (``benchmarks/cross_entropy_launch.py`` sweeps them).
    """
    n_rows, n_cols = logits.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = min(_MAX_VOCAB_BLOCK, triton.next_power_of_2(n_cols))  # rows loop over blocks: any vocab
    _cross_entropy_rows[(n_rows,)](
        logits, targets, row_loss, inv_count, inv_count.stride(0) if inv_count.dim() else 0, logits.stride(0), n_cols,
        ignore_index, logit_scale, BLOCK=block,
        num_warps=num_warps or num_warps_for(block, logits.device),
    )  # fmt: skip
    return row_loss
