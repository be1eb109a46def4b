"""Cross-entropy over rows of logits that also writes d(loss)/d(logits) in place, as a Triton kernel.

The per-chunk step of ``linear_cross_entropy``: a program reads a row twice, once for the online
max and sum of exponentials (log-sum-exp), once to overwrite each logit with its gradient
``scale * (softmax - one_hot) / count``. No second (rows, vocab) tensor is ever allocated.

The kernel is bound by memory traffic, so the second read should come from L2, not HBM. A grid of
one program per row keeps hundreds of rows in flight, and the rows read in between evict a row
before its second pass (a 50,368-token row is 100 KB in bf16). Instead, a few programs per
multiprocessor loop over the rows (a persistent grid): the rows in flight then fit in L2, and the
second pass walks each row backwards, starting from the blocks read last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundry.kernels.device import lazy_jit, num_warps_for, parallel_programs

# A block of the vocabulary per loop step; rows of any length loop over it.
_MAX_VOCAB_BLOCK = 4096
# Programs per multiprocessor of the persistent grid: enough loads in flight to keep HBM busy,
# few enough rows in flight (about 2 x 132 x 100 KB on an H100) to stay in its 50 MB L2.
PROGRAMS_PER_MULTIPROCESSOR = 2


@lazy_jit
def _cross_entropy_rows(
    logits_ptr, targets_ptr, row_loss_ptr, inv_count_ptr, n_rows, row_stride, n_cols, ignore_index, logit_scale,
    BLOCK: tl.constexpr,
):  # fmt: skip
    inv_count = tl.load(inv_count_ptr)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + tl.cast(row, tl.int64) * row_stride
        target = tl.load(targets_ptr + row).to(tl.int64)
        is_ignored = target == ignore_index
        running_max = float("-inf")
        exp_sum = 0.0
        for block in range(0, n_blocks):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * logit_scale
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            exp_sum = exp_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        log_sum_exp = running_max + tl.log(exp_sum)
        target_in_row = (target >= 0) & (target < n_cols)
        target_logit = tl.load(row_ptr + target, mask=target_in_row & ~is_ignored, other=0.0).to(tl.float32)
        tl.store(row_loss_ptr + row, tl.where(is_ignored, 0.0, log_sum_exp - target_logit * logit_scale))
        grad_scale = tl.where(is_ignored, 0.0, logit_scale * inv_count)
        for step in range(0, n_blocks):  # backwards: the blocks read last are the likeliest in L2
            cols = (n_blocks - 1 - step) * BLOCK + tl.arange(0, BLOCK)
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
    programs_per_multiprocessor: int = PROGRAMS_PER_MULTIPROCESSOR,
    block: int | None = None,
) -> torch.Tensor:
    """Per-row losses (rows,) in fp32; ``logits`` (rows, vocab) is overwritten with d(mean loss)/d(logits).

    ``inv_count`` is 1 / (non-ignored targets in the whole batch), a device scalar, so chunks of one
    batch share the global denominator without a host sync. ``programs_per_multiprocessor`` and
    ``block`` (a power of two; None = up to 4,096) set the launch; the benchmarks sweep them.
    """
    n_rows, n_cols = logits.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if block is None:
        block = min(_MAX_VOCAB_BLOCK, triton.next_power_of_2(n_cols))  # rows loop over blocks: any vocab
    n_programs = max(1, min(n_rows, programs_per_multiprocessor * parallel_programs(logits.device)))
    _cross_entropy_rows[(n_programs,)](
        logits, targets, row_loss, inv_count, n_rows, logits.stride(0), n_cols, ignore_index, logit_scale,
        BLOCK=block, num_warps=num_warps_for(block, logits.device),
    )  # fmt: skip
    return row_loss
