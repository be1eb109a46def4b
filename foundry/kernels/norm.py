"""RMSNorm and LayerNorm, forward and backward, as one Triton kernel pair (``SUBTRACT_MEAN`` picks which).

One program normalises one row in fp32 and caches its ``rstd`` (and mean) for the backward. The
backward gives each program a contiguous run of rows, so the weight/bias gradients are summed in
registers and only one partial per program is written, then reduced across programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundry.kernels.device import (
    lazy_jit,
    num_warps_for,
    parallel_programs,
    require_kernels,
    row_block,
)


@lazy_jit
def _norm_forward(
    x_ptr, weight_ptr, bias_ptr, y_ptr, mean_ptr, rstd_ptr, x_row_stride, y_row_stride, n_cols, eps,
    SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if SUBTRACT_MEAN:
        mean = tl.sum(x, axis=0) / n_cols
        x = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    y = x * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _norm_backward(
    dy_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr, dx_ptr, dweight_partial_ptr, dbias_partial_ptr,
    dy_row_stride, x_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program,
    SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dweight = tl.zeros((BLOCK,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK,), dtype=tl.float32)
    first_row = program * rows_per_program
    for offset in range(0, rows_per_program):
        row = first_row + offset
        if row < n_rows:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if SUBTRACT_MEAN:
                x = x - tl.load(mean_ptr + row)
            x_hat = tl.where(mask, x * tl.load(rstd_ptr + row), 0.0)
            weighted_dy = dy * weight
            # d/dx of x_hat * w: rstd * (w dy - x_hat * mean(w dy x_hat) [- mean(w dy) for LayerNorm])
            correction = x_hat * (tl.sum(weighted_dy * x_hat, axis=0) / n_cols)
            if SUBTRACT_MEAN:
                correction += tl.sum(weighted_dy, axis=0) / n_cols
            dx = (weighted_dy - correction) * tl.load(rstd_ptr + row)
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dweight += dy * x_hat
            if HAS_BIAS:
                dbias += dy
    tl.store(dweight_partial_ptr + program * n_cols + cols, dweight, mask=mask)
    if HAS_BIAS:
        tl.store(dbias_partial_ptr + program * n_cols + cols, dbias, mask=mask)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, subtract_mean, out_dtype):  # type: ignore[override]
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        n_rows, n_cols = x2d.shape
        kernel = "layer_norm" if subtract_mean else "rms_norm"
        block = row_block(n_cols, kernel)
        y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        mean = torch.empty(n_rows if subtract_mean else 0, dtype=torch.float32, device=x.device)
        num_warps = num_warps_for(block, x.device)
        _norm_forward[(n_rows,)](
            x2d, weight, bias if bias is not None else weight, y, mean, rstd, x2d.stride(0), y.stride(0), n_cols,
            eps, SUBTRACT_MEAN=subtract_mean, HAS_BIAS=bias is not None, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias, ctx.subtract_mean, ctx.block, ctx.num_warps = bias is not None, subtract_mean, block, num_warps
        ctx.x_dtype, ctx.bias_dtype = x.dtype, bias.dtype if bias is not None else None
        return y.view(*shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2d, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        dy2d = dy.reshape(n_rows, n_cols)
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        programs = max(1, min(n_rows, parallel_programs(x2d.device)))
        rows_per_program = triton.cdiv(n_rows, programs)
        dx = torch.empty((n_rows, n_cols), dtype=ctx.x_dtype, device=x2d.device)
        dweight_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2d.device)
        dbias_partial = torch.empty((programs if ctx.has_bias else 0, n_cols), dtype=torch.float32, device=x2d.device)
        _norm_backward[(programs,)](
            dy2d, x2d, weight, mean, rstd, dx, dweight_partial, dbias_partial, dy2d.stride(0), x2d.stride(0),
            dx.stride(0), n_rows, n_cols, rows_per_program, SUBTRACT_MEAN=ctx.subtract_mean, HAS_BIAS=ctx.has_bias,
            BLOCK=ctx.block, num_warps=ctx.num_warps,
        )  # fmt: skip
        dweight = dweight_partial.sum(0).to(weight.dtype)
        dbias = dbias_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(dy.shape), dweight, dbias, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, returned in ``out_dtype`` (x's)."""
    require_kernels(x, "rms_norm")
    return _Norm.apply(x, weight, None, eps, False, out_dtype or x.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim (weight required, bias optional), in fp32, returned in ``out_dtype``."""
    require_kernels(x, "layer_norm")
    return _Norm.apply(x, weight, bias, eps, True, out_dtype or x.dtype)
