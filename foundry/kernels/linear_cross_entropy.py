"""Output projection + cross-entropy, chunked over tokens, so the (tokens, vocab) logits never exist.

For each chunk of tokens: logits = hidden_chunk @ weight.T (a cuBLAS GEMM), then the loss and
d(loss)/d(logits) in place (the Triton kernel of ``cross_entropy.py``, or PyTorch where Triton
cannot run), then grad_hidden_chunk = dlogits @ weight and grad_weight += dlogits.T @ hidden_chunk.
The gradients are finished in the forward; the backward only scales them by the incoming gradient.
A chunk's logits take at most ``CHUNK_LOGITS_BYTES`` (1 GiB), so the extra memory is bounded by
that plus the fp32 weight gradient instead of growing with tokens x vocab. Chunks that large keep
the three GEMMs of a chunk at full speed and the fp32 weight-gradient accumulation a small share of
the time. With chunks the size of ``hidden`` instead (1,024 tokens for MPT-125M: 64 small GEMM
triples and 64 accumulations of a 50,368 x 768 fp32 gradient per microbatch) the fused loss ran
slower than the compiled unfused one (docs/PERFORMANCE.md).

With ``reduction="none"`` it returns each token's loss instead of the mean (minus each token's
log-probability, which DPO sums per sequence). Their upstream gradient differs token by token and is
known only in the backward, so the forward keeps no gradient: the backward computes each chunk's
logits again (one more GEMM per chunk) and the kernel scales each row's gradient by that row's
upstream gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

from foundry.core.precision import autocast_dtype
from foundry.kernels.device import kernels_run_on
from foundry.kernels.weight_grad import add_weight_grad_

IGNORE_INDEX = -100
CHUNK_LOGITS_BYTES = 1 << 30


def chunk_tokens_for(n_tokens: int, vocab_size: int, element_size: int) -> int:
    """Tokens per chunk: the largest power of two whose (chunk, vocab) logits fit ``CHUNK_LOGITS_BYTES``."""
    fitting_tokens = max(1, CHUNK_LOGITS_BYTES // (vocab_size * element_size))
    return min(n_tokens, 1 << (fitting_tokens.bit_length() - 1))


def _cross_entropy_rows_torch_(
    logits: torch.Tensor, targets: torch.Tensor, inv_count: torch.Tensor, logit_scale: float, ignore_index: int
) -> torch.Tensor:
    """``cross_entropy_rows_`` in PyTorch (for devices without Triton): same outputs, one chunk of fp32 scratch."""
    is_valid = targets != ignore_index
    safe_targets = torch.where(is_valid, targets, 0)[:, None]
    log_probs = (logits.float() * logit_scale).log_softmax(dim=-1)
    row_loss = -log_probs.gather(1, safe_targets).squeeze(1) * is_valid
    grad = log_probs.exp_()
    grad.scatter_add_(1, safe_targets, -torch.ones_like(safe_targets, dtype=grad.dtype))
    logits.copy_(grad * (is_valid * (logit_scale * inv_count))[:, None])
    return row_loss


def _cross_entropy_rows_(logits: torch.Tensor, *args: object) -> torch.Tensor:
    if kernels_run_on(logits.device):
        from foundry.kernels.cross_entropy import cross_entropy_rows_  # imports triton: only where it runs

        return cross_entropy_rows_(logits, *args)
    return _cross_entropy_rows_torch_(logits, *args)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would run in here: autocast's if on, else the promoted input dtype."""
    return autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, logit_scale, ignore_index, chunk_tokens):  # type: ignore[override]
        n_tokens = hidden.shape[0]
        dtype = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
            inv_count = 1.0 / (targets != ignore_index).sum().float()  # on device: no host sync
            loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden_c) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, n_tokens, chunk_tokens):
                hidden_chunk = hidden_c[start : start + chunk_tokens]  # (chunk, d_model)
                logits = hidden_chunk @ weight_c.T  # (chunk, vocab); becomes d(loss)/d(logits)
                row_loss = _cross_entropy_rows_(
                    logits, targets[start : start + chunk_tokens], inv_count, logit_scale, ignore_index
                )
                loss_sum += row_loss.sum()
                if grad_hidden is not None:
                    torch.mm(logits, weight_c, out=grad_hidden[start : start + chunk_tokens])
                if ctx.needs_input_grad[1]:
                    add_weight_grad_(grad_weight, logits, hidden_chunk)  # fp32 sum inside the GEMM
        ctx.save_for_backward(grad_hidden, grad_weight if ctx.needs_input_grad[1] else None)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss_sum * inv_count

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _LinearTokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, logit_scale, ignore_index, chunk_tokens):  # type: ignore[override]
        dtype = _compute_dtype(hidden, weight)
        no_gradient = torch.zeros((), dtype=torch.float32, device=hidden.device)  # the kernel writes zeros
        token_losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_tokens):
                chunk = slice(start, start + chunk_tokens)
                logits = hidden_c[chunk] @ weight_c.T  # (chunk, vocab)
                token_losses[chunk] = _cross_entropy_rows_(
                    logits, targets[chunk], no_gradient, logit_scale, ignore_index
                )
        ctx.save_for_backward(hidden, weight, targets)
        ctx.settings = dtype, logit_scale, ignore_index, chunk_tokens
        return token_losses

    @staticmethod
    def backward(ctx, grad_losses):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        dtype, logit_scale, ignore_index, chunk_tokens = ctx.settings
        row_scales = grad_losses.float().contiguous()  # (tokens,): each token's upstream gradient
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
            grad_hidden = torch.empty_like(hidden_c) if ctx.needs_input_grad[0] else None
            grad_weight = None
            if ctx.needs_input_grad[1]:
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                chunk = slice(start, start + chunk_tokens)
                hidden_chunk = hidden_c[chunk]  # (chunk, d_model)
                logits = hidden_chunk @ weight_c.T  # (chunk, vocab); becomes d(Σ upstream·loss)/d(logits)
                _cross_entropy_rows_(logits, targets[chunk], row_scales[chunk], logit_scale, ignore_index)
                if grad_hidden is not None:
                    torch.mm(logits, weight_c, out=grad_hidden[chunk])
                if grad_weight is not None:
                    add_weight_grad_(grad_weight, logits, hidden_chunk)
        grad_hidden = grad_hidden.to(hidden.dtype) if grad_hidden is not None else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None


# A loop of GEMMs around a Triton launch: nothing for inductor to fuse, so a compiled caller
# (torch_compile scope: model) runs it as is instead of tracing the loop.
@torch.compiler.disable
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    logit_scale: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    reduction: Literal["mean", "none"] = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(logit_scale * hidden @ weight.T, targets, reduction=reduction)``, chunked.

    Args:
        hidden: (..., d_model) final hidden states.
        weight: (vocab, d_model) output projection (the tied embedding or ``lm_head``).
        targets: (...) token ids; ``ignore_index`` marks positions without a loss.
        logit_scale: multiplies the logits (MPT's ``logit_scale``); None = 1.
        chunk_tokens: tokens per chunk; None picks ``chunk_tokens_for``.
        reduction: ``mean`` over non-ignored targets, or ``none``: each token's loss, fp32 of ``targets``'
            shape, 0 where ignored.
    """
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk_tokens is None:
        itemsize = _compute_dtype(flat_hidden, weight).itemsize
        chunk_tokens = chunk_tokens_for(flat_hidden.shape[0], weight.shape[0], itemsize)
    scale = 1.0 if logit_scale is None else float(logit_scale)
    arguments = flat_hidden, weight, flat_targets, scale, ignore_index, chunk_tokens
    if reduction == "none":
        return _LinearTokenCrossEntropy.apply(*arguments).view(targets.shape)
    return _LinearCrossEntropy.apply(*arguments)
