"""End-aligned causal attention as a full block plus a causal square, merged by log-sum-exp (the CPU kernel)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from unittest import mock

import pytest
import torch
from helpers import builds_graphs

from foundry.distributed.split_attention import end_aligned_attention, in_layout, split_kernel


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with query i seeing keys up to keys - queries + i, in the inputs' dtype."""
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(("queries", "keys"), [(8, 24), (5, 13), (8, 8)], ids=["tail", "uneven", "square"])
def test_merged_pieces_equal_one_end_aligned_softmax_forward_and_backward(queries, keys) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=generator, dtype=torch.float64) for n in (queries, keys, keys))
    weights = torch.randn(2, 3, queries, 16, generator=generator, dtype=torch.float64)
    got, want = {}, {}
    for found, attend in ((got, lambda *x: end_aligned_attention(*x, 16**-0.5, "cpu")),
                          (want, lambda *x: reference(*x, 16**-0.5))):  # fmt: skip
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        (out * weights).sum().backward()
        found.update(out=out.detach(), q=leaves[0].grad, k=leaves[1].grad, v=leaves[2].grad)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_bf16_pieces_merge_in_fp32_as_close_as_one_bf16_kernel_call() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 32, generator=generator) for n in (16, 64, 64))
    exact = reference(q.double(), k.double(), v.double(), 32**-0.5)
    merged = end_aligned_attention(*(x.bfloat16() for x in (q, k, v)), 32**-0.5, "cpu").double()
    one_call = reference(*(x.bfloat16() for x in (q, k, v)), 32**-0.5).double()
    assert (merged - exact).abs().max() <= 2 * (one_call - exact).abs().max()


def test_a_gradient_in_another_layout_reaches_the_kernels_as_the_output_is_laid_out() -> None:
    """The models hand attention's output on as a transposed view, so its gradient arrives strided."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, generator=generator, dtype=torch.float64) for n in (4, 12, 12))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grad = torch.randn(1, 4, 2, 8, generator=generator, dtype=torch.float64).transpose(1, 2)  # (b, h, s, d) view
    end_aligned_attention(*leaves, 8**-0.5, "cpu").backward(grad)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    reference(*ref_leaves, 8**-0.5).backward(grad)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_fewer_keys_than_queries_is_refused_and_kernels_are_chosen_by_device() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="at least as many keys as queries: 4 < 8"):
        end_aligned_attention(q, q[:, :, :4], q[:, :, :4], 0.25, "cpu")
    assert split_kernel(q) == "cpu"
    assert split_kernel(q.to("meta")) is None


def test_no_split_kernel_on_a_rocm_or_pre_ampere_gpu(monkeypatch) -> None:
    """Neither has cuDNN's fused attention: ``auto`` runs end_aligned there (a stand-in for a GPU tensor)."""
    gpu_like = mock.Mock(is_cuda=True, dtype=torch.bfloat16, shape=(1, 2, 8, 64))
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert split_kernel(gpu_like) == "cudnn"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))  # V100: no cuDNN attention
    assert split_kernel(gpu_like) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert split_kernel(gpu_like) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_gpu_kernels_merge_within_bf16_error_forward_and_backward(kernel) -> None:
    """On the GPU kernels a CP rank's longer prefix runs on: errors against fp64 within twice one bf16 call's."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, n, 128, generator=generator) for n in (512, 2048, 2048))
    weights = torch.randn(1, 4, 512, 128, generator=generator).cuda()
    found = {}
    for name, dtype, attend in (
        ("exact", torch.float64, lambda *x: reference(*x, 128**-0.5)),
        ("bf16_once", torch.bfloat16, lambda *x: reference(*x, 128**-0.5)),
        ("merged", torch.bfloat16, lambda *x: end_aligned_attention(*x, 128**-0.5, kernel)),
    ):
        leaves = [x.to("cuda", dtype).requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        (out.double() * weights.double()).sum().backward()
        found[name] = [t.detach().double() for t in (out, *(x.grad for x in leaves))]
    for tensor, exact, once, merged in zip(("out", "q", "k", "v"), *found.values(), strict=True):
        assert (merged - exact).abs().max() <= 2 * (once - exact).abs().max() + 1e-3, tensor


def test_kernel_state_reaches_each_backward_eager_and_compiled(monkeypatch) -> None:
    """The GPU kernels return state tensors their backward needs (their RNG state): a kernel built on the CPU's
    returns its piece's key count as such a state and scales its gradients by keys-in-state / keys, which is 1
    only where each piece's backward gets its own state back, eager and compiled."""
    from foundry.distributed import split_attention

    def forward(q, k, v, causal, scale):
        out, lse, _ = split_attention.KERNELS["cpu"].forward(q, k, v, causal, scale)
        return out, lse, [torch.full((1,), float(k.shape[2]))]

    def backward(grad, q, k, v, out, lse, state, causal, scale):
        (keys,) = state
        grads = split_attention.KERNELS["cpu"].backward(grad, q, k, v, out, lse, [], causal, scale)
        return tuple(g * (keys / k.shape[2]) for g in grads)

    monkeypatch.setitem(split_attention.KERNELS, "stateful", split_attention.SplitKernel(forward, backward))
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 8, generator=generator) for n in (4, 12, 12))
    grads = {}
    for name, kernel, compiled in (("cpu", "cpu", False), ("eager", "stateful", False), ("compiled", "stateful", True)):
        attend = functools.partial(end_aligned_attention, scale=8**-0.5, kernel=kernel)
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True) if compiled else attend
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with builds_graphs() if compiled else contextlib.nullcontext():
            attend(*leaves).sum().backward()
        grads[name] = [x.grad for x in leaves]
    for name in ("eager", "compiled"):
        for got, want in zip(grads[name], grads["cpu"], strict=True):
            torch.testing.assert_close(got, want)


def test_split_with_dropout_warns_and_runs_the_end_aligned_chunk() -> None:
    from foundry.distributed.context_parallel import _sdpa_prefix_attention

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 2, 8, generator=generator) for n in (4, 12, 12))  # (batch, seq, heads, dim)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="'split', but attention dropout is on: the chunks run 'end_aligned'"):
        split = _sdpa_prefix_attention(q, k, v, 8**-0.5, 0.5, attention="split")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto, the default, runs end_aligned there without a word
        auto = _sdpa_prefix_attention(q, k, v, 8**-0.5, 0.5)
    torch.manual_seed(0)
    end_aligned = _sdpa_prefix_attention(q, k, v, 8**-0.5, 0.5, attention="end_aligned")
    torch.testing.assert_close(split, end_aligned)
    torch.testing.assert_close(auto, end_aligned)


def test_auto_splits_where_a_kernel_runs_and_end_aligned_does_not() -> None:
    from foundry.distributed import split_attention
    from foundry.distributed.context_parallel import _sdpa_prefix_attention

    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, n, 2, 8, generator=generator) for n in (4, 12, 12))  # (batch, seq, heads, dim)
    cpu = split_attention.KERNELS["cpu"]
    for attention, kernel_calls in (("auto", 2), ("split", 2), ("end_aligned", 0)):
        calls: list[int] = []
        counting = split_attention.SplitKernel(
            lambda *args, calls=calls: calls.append(1) or cpu.forward(*args), cpu.backward
        )
        with mock.patch.dict(split_attention.KERNELS, {"cpu": counting}):
            _sdpa_prefix_attention(q, k, v, 8**-0.5, 0.0, attention=attention)
        assert len(calls) == kernel_calls, attention


def test_a_gradient_is_copied_into_the_output_layout_only_where_a_read_stride_differs() -> None:
    out = torch.empty(1, 6, 4, 8).transpose(1, 2)  # (batch, heads, seq, dim) laid out as (batch, seq, heads, dim)
    batch_padded = torch.randn(1, 12, 4, 8).transpose(1, 2)[:, :, :6]  # only the size-1 batch's stride differs
    assert in_layout(batch_padded, out.stride()) is batch_padded
    head_padded = torch.randn(1, 8, 6, 8)[:, :4]
    copied = in_layout(head_padded, out.stride())
    assert copied.stride() == out.stride() and torch.equal(copied, head_padded)
