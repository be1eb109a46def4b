from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from foundry.kernels.linear_cross_entropy import (
    CHUNK_LOGITS_BYTES,
    _cross_entropy_rows_torch_,
    chunk_tokens_for,
    linear_cross_entropy,
)


def _problem(tokens: int = 26, d_model: int = 24, vocab: int = 77) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(2, tokens // 2, d_model).requires_grad_()
    weight = (torch.randn(vocab, d_model) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (2, tokens // 2))
    targets[0, 3] = targets[1, :4] = -100
    return hidden, weight, targets


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    logits = (hidden @ weight.T).float() * scale
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("chunk_tokens", [5, 26, None])
@pytest.mark.parametrize("logit_scale", [None, 0.37])
def test_loss_and_grads_match_unfused_cross_entropy_in_fp32(
    chunk_tokens: int | None, logit_scale: float | None
) -> None:
    hidden, weight, targets = _problem()
    loss = linear_cross_entropy(hidden, weight, targets, logit_scale, chunk_tokens=chunk_tokens)
    expected = _reference(hidden, weight, targets, logit_scale or 1.0)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    # An upstream gradient other than 1 (gradient accumulation scales each microbatch's loss).
    grads = torch.autograd.grad(loss * 0.7, (hidden, weight))
    expected_grads = torch.autograd.grad(expected * 0.7, (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_rows_longer_than_one_block_loop_over_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Vocabularies wider than the kernel's block (Llama 3's 128256) are read block by block."""
    monkeypatch.setattr("foundry.kernels.cross_entropy._MAX_VOCAB_BLOCK", 32)
    hidden, weight, targets = _problem()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=13)
    expected = _reference(hidden, weight, targets, 1.0)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for got, want in zip(torch.autograd.grad(loss, weight), torch.autograd.grad(expected, weight), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_unfused_within_bf16_precision() -> None:
    hidden, weight, targets = _problem()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
        expected = _reference(hidden, weight, targets, 1.0)
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]  # the parameters' dtype
    for got, want in zip(grads, torch.autograd.grad(expected, (hidden, weight)), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_pytorch_path_matches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Triton cannot run (CPU without the interpreter) the per-chunk step is PyTorch, with the same results."""
    hidden, weight, targets = _problem()
    with_kernel = linear_cross_entropy(hidden, weight, targets, 0.5, chunk_tokens=8)
    kernel_grads = torch.autograd.grad(with_kernel, (hidden, weight))
    monkeypatch.setattr("foundry.kernels.linear_cross_entropy.kernels_run_on", lambda device: False)
    without_kernel = linear_cross_entropy(hidden, weight, targets, 0.5, chunk_tokens=8)
    torch.testing.assert_close(without_kernel, with_kernel, rtol=1e-6, atol=0)
    for got, want in zip(torch.autograd.grad(without_kernel, (hidden, weight)), kernel_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor (in bytes) any op returns, the interpreter's copies of kernel arguments included."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, tensor.numel() * tensor.element_size())
        return out


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
@pytest.mark.parametrize("chunk_tokens", [5, None])
def test_per_token_losses_and_their_grads_match_unfused_cross_entropy_in_fp32(
    path: str, chunk_tokens: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "pytorch":
        monkeypatch.setattr("foundry.kernels.linear_cross_entropy.kernels_run_on", lambda device: False)
    hidden, weight, targets = _problem()
    losses = linear_cross_entropy(hidden, weight, targets, 0.37, chunk_tokens=chunk_tokens, reduction="none")
    logits = (hidden @ weight.T).float() * 0.37
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")  # 0 if ignored
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    generator = torch.Generator().manual_seed(0)  # a CPU generator, whatever the default device
    upstream = torch.randn(targets.shape, generator=generator, device="cpu").to(losses)  # a gradient per token
    grads = torch.autograd.grad((losses * upstream).sum(), (hidden, weight))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
def test_never_allocates_tokens_by_vocab(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "pytorch":
        monkeypatch.setattr("foundry.kernels.linear_cross_entropy.kernels_run_on", lambda device: False)
    tokens, d_model, vocab = 64, 8, 160
    fp32_bytes = 4
    monkeypatch.setattr("foundry.kernels.linear_cross_entropy.CHUNK_LOGITS_BYTES", tokens * vocab * fp32_bytes // 8)
    hidden, weight, targets = _problem(tokens, d_model, vocab)
    with _LargestAllocation() as recorder:
        token_losses = linear_cross_entropy(hidden, weight, targets, reduction="none")
        loss = linear_cross_entropy(hidden, weight, targets) + token_losses.sum()
        loss.backward()
    # The largest fp32 tensor is a chunk's logits or the weight (gradient), never the whole logits.
    assert chunk_tokens_for(tokens, vocab, fp32_bytes) == tokens // 8
    assert recorder.largest_bytes <= max(tokens // 8 * vocab, vocab * d_model) * fp32_bytes
    assert recorder.largest_bytes < tokens * vocab * fp32_bytes // 4


def test_chunks_are_the_largest_power_of_two_of_tokens_within_the_logits_budget() -> None:
    # MPT's vocabulary in bf16: 10,658 tokens fit in 1 GiB, so chunks of 8,192.
    assert chunk_tokens_for(65536, 50368, 2) == 8192
    assert chunk_tokens_for(65536, 50368, 2) * 50368 * 2 <= CHUNK_LOGITS_BYTES
    assert chunk_tokens_for(65536, 128256, 2) == 4096  # Llama 3's vocabulary
    assert chunk_tokens_for(1000, 50368, 2) == 1000  # a short input: one chunk
    assert chunk_tokens_for(10, 2**40, 4) == 1  # a vocabulary past the budget still makes progress


@pytest.mark.parametrize("num_warps", [None, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_at_any_warp_count_gives_the_losses_and_gradients_of_pytorch(
    num_warps: int | None, dtype: torch.dtype, assert_close
) -> None:
    from foundry.kernels.cross_entropy import cross_entropy_rows_

    rows, vocab = 11, 77
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    targets[4] = -100
    inv_count = torch.tensor(1.0 / 10)
    expected_logits = logits.clone()
    expected_loss = _cross_entropy_rows_torch_(expected_logits, targets, inv_count, 0.5, -100)
    loss = cross_entropy_rows_(logits, targets, inv_count, 0.5, -100, num_warps)
    assert_close(loss, expected_loss, torch.float32)
    assert_close(logits, expected_logits, dtype)
    assert loss[4] == 0 and (logits[4] == 0).all()  # an ignored row: no loss, no gradient


def test_kernel_scales_each_rows_gradient_by_its_own_factor(assert_close) -> None:
    """Per-token log-probabilities: each row's upstream gradient scales that row."""
    from foundry.kernels.cross_entropy import cross_entropy_rows_

    rows, vocab = 6, 77
    logits = torch.randn(rows, vocab) * 3
    targets = torch.randint(0, vocab, (rows,))
    row_scales = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.25, -3.0])
    expected_logits = logits.clone()
    expected_loss = _cross_entropy_rows_torch_(expected_logits, targets, row_scales, 0.5, -100)
    loss = cross_entropy_rows_(logits, targets, row_scales, 0.5, -100)
    assert_close(loss, expected_loss, torch.float32)
    assert_close(logits, expected_logits, torch.float32)
    assert loss[2] > 0 and (logits[2] == 0).all()  # a row scaled by 0 keeps its loss, not its gradient
