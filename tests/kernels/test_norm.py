from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundry.kernels.norm import layer_norm, rms_norm
from foundry.models.layers import RMSNorm

SHAPES = [(2, 5, 37), (3, 64), (1, 7, 128)]


def _grads(output: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)  # a CPU generator, whatever the default device
    upstream = torch.randn(output.shape, generator=generator, device="cpu").to(output)
    return torch.autograd.grad(output, inputs, upstream)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (torch.randn(shape) * 3 + 1).to(dtype).requires_grad_()
    weight = torch.randn(shape[-1]).requires_grad_()
    bias = torch.randn(shape[-1]).requires_grad_()
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_foundry_rmsnorm(shape: tuple[int, ...], dtype: torch.dtype, assert_close) -> None:
    x, weight, _ = _inputs(shape, dtype)
    reference = RMSNorm(shape[-1], eps=1e-5)
    reference.weight = torch.nn.Parameter(weight.detach().clone())
    expected = reference(x)
    actual = rms_norm(x, weight, 1e-5)
    assert actual.dtype == expected.dtype
    assert_close(actual, expected, dtype)
    for got, want in zip(_grads(actual, (x, weight)), _grads(expected, (x, reference.weight)), strict=True):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_torch(shape: tuple[int, ...], dtype: torch.dtype, with_bias: bool, assert_close) -> None:
    x, weight, bias = _inputs(shape, dtype)
    bias = bias if with_bias else None
    inputs = (x, weight, bias) if with_bias else (x, weight)
    expected = F.layer_norm(x.float(), shape[-1:], weight, bias, 1e-5).to(dtype)
    actual = layer_norm(x, weight, bias, 1e-5)
    assert_close(actual, expected, dtype)
    for got, want in zip(_grads(actual, inputs), _grads(expected, inputs), strict=True):
        assert_close(got, want, dtype)


def test_norm_returns_the_requested_dtype_and_parameter_dtype_grads() -> None:
    x, weight, bias = _inputs((4, 24), torch.float32)
    y = layer_norm(x, weight, bias, 1e-5, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    dx, dweight, dbias = _grads(y, (x, weight, bias))
    assert (dx.dtype, dweight.dtype, dbias.dtype) == (torch.float32,) * 3


def test_rms_norm_reads_strided_rows(assert_close) -> None:
    base = torch.randn(6, 40)
    x = base[:, :33]  # rows 40 apart, 33 wide
    weight = torch.randn(33)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert_close(rms_norm(x, weight, 1e-6), expected, torch.float32)
