"""Linear layers whose weight gradient is summed inside the GEMM, and whose bf16 weights are cast once a batch.

With gradient accumulation and autocast, each ``nn.Linear`` of an unsharded model costs three
passes over its weights per microbatch beyond the GEMMs: autocast casts the fp32 weight to bf16,
autograd casts the bf16 weight gradient back to fp32, and ``AccumulateGrad`` adds it to ``.grad``
(read two fp32 tensors, write one): for a 1.3B-parameter model about 26 GB of memory traffic per
microbatch. Removing it bought MPT-1B 1.1 MFU points on an H100 (docs/PERFORMANCE.md).
``accumulate_weight_grads_in_place`` swaps each trainable ``nn.Linear`` for ``AccumulatingLinear``, whose backward adds
``grad_output.T @ input`` to an fp32 sum inside the GEMM (``add_weight_grad_``) and whose
forward reads a bf16 copy of the weight cast once a batch. Megatron-LM's
``gradient_accumulation_fusion`` is the same idea. The weights must change only between batches
(optimizer steps, checkpoint loads, algorithms at BATCH_START or earlier): ``start_batch`` marks them for a new cast.

The sum *is* the parameter's ``.grad``: ``WeightGradSums.prepare`` (the Trainer calls it before each
microbatch) points ``.grad`` at it, and zeroes it when ``.grad`` was cleared (``zero_grad``), so
clipping, optimizers, checkpoints and ``set_to_none`` behave as with autograd's own accumulation.
A module whose sums were never prepared (eval, inference, a model used outside the Trainer) runs as
a plain ``nn.Linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from foundry.core.precision import autocast_dtype


@functools.cache
def gemm_accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` of ``dtype`` matrices into an fp32 sum runs on ``device``.

    CUDA builds of torch 2.11 have it (the GPU test); CPU does not. Asked once per device and dtype.
    """
    total = torch.zeros(2, 2, dtype=torch.float32, device=device)
    ones = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(total, ones, ones, out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((total == 2).all())


def add_weight_grad_(grad_sum: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    """``grad_sum += grad_output.T @ inputs`` (2-D), the fp32 sum accumulated inside the GEMM where it can be.

    Adding a bf16 product to the fp32 sum instead is one more pass over the fp32 sum and rounds the
    product to bf16 first; that is the fallback where the GEMM cannot write fp32 (CPU).
    """
    if grad_output.dtype == grad_sum.dtype:
        grad_sum.addmm_(grad_output.T, inputs)
    elif gemm_accumulates_in_fp32(grad_sum.device, grad_output.dtype):
        torch.addmm(grad_sum, grad_output.T, inputs, out_dtype=grad_sum.dtype, out=grad_sum)
    else:
        grad_sum += (grad_output.T @ inputs).to(grad_sum.dtype)


# An opaque op that declares its mutation: a compiled backward calls it on the sum in place (inductor
# would otherwise write the GEMM's result to a new buffer and copy it into the sum: the pass saved here).
@torch.library.custom_op("foundry::add_weight_grad_", mutates_args=("grad_sum",))
def _add_weight_grad_op(grad_sum: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    add_weight_grad_(grad_sum, grad_output, inputs)


class _LinearSummingWeightGrad(torch.autograd.Function):
    """``F.linear`` in the autocast dtype whose weight gradient goes into ``grad_sum``, not autograd."""

    @staticmethod
    def forward(ctx, x, weight, compute_weight, bias, grad_sum):  # type: ignore[override]
        # ``weight`` only ties the output to the graph (it gets no gradient from autograd): without it a
        # layer whose input needs no gradient would return a tensor that backward cannot start from.
        # ``compute_weight`` None: the weight itself (fp32), not passed twice, which torch.compile cannot trace.
        compute_weight = weight if compute_weight is None else compute_weight
        dtype = compute_weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            x_c = x.to(dtype)
            y = F.linear(x_c, compute_weight, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_c, compute_weight)
        # Not a saved tensor: autograd would refuse a second use of the layer in one graph, whose
        # backward finds the sum already changed by the first's.
        ctx.grad_sum = grad_sum
        ctx.dtypes = x.dtype, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x_c, compute_weight = ctx.saved_tensors
        x_dtype, bias_dtype = ctx.dtypes
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        _add_weight_grad_op(ctx.grad_sum, grad_2d, x_c.reshape(-1, x_c.shape[-1]))
        grad_x = (grad_y @ compute_weight).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0, dtype=torch.float32).to(bias_dtype) if bias_dtype is not None else None
        return grad_x, None, None, grad_bias, None


class AccumulatingLinear(nn.Linear):
    """``nn.Linear`` that, once prepared, sums its weight gradient into ``weight_grad_sum`` (the weight's ``.grad``).

    ``compute_weight`` is the weight in the autocast dtype, cast again by ``WeightGradSums.prepare``
    after each ``start_batch``; None (fp32 runs) means the weight itself.
    """

    weight_grad_sum: torch.Tensor | None
    compute_weight: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_sum is None or not torch.is_grad_enabled():
            return super().forward(x)
        compute_weight = self.compute_weight
        if compute_weight is None or compute_weight.dtype != (autocast_dtype(x.device.type) or self.weight.dtype):
            compute_weight = self.weight.to(autocast_dtype(x.device.type) or self.weight.dtype)
        if compute_weight is self.weight:  # fp32: the Function reads the weight itself
            compute_weight = None
        return _LinearSummingWeightGrad.apply(x, self.weight, compute_weight, self.bias, self.weight_grad_sum)


class WeightGradSums:
    """The ``AccumulatingLinear`` modules of a model, grouped by weight (a weight may be shared)."""

    def __init__(self, modules_by_weight: dict[nn.Parameter, list[AccumulatingLinear]]) -> None:
        self._modules_by_weight = modules_by_weight
        self._recast = True  # the weights may have changed since the last cast

    def __len__(self) -> int:
        return len(self._modules_by_weight)

    def start_batch(self) -> None:
        """The weights may have changed (an optimizer step, a checkpoint load, an EMA swap): cast them again.

        Called by the Trainer at every batch start. A flag, not a check of the weights' version counters:
        optimizers that write ``p.data`` (or fused kernels) change a weight without bumping its version.
        """
        self._recast = True

    def prepare(self, compute_dtype: torch.dtype | None) -> None:
        """Before a training microbatch: every weight's ``.grad`` is its sum (zeroed if ``.grad`` was cleared),
        and its ``compute_dtype`` copy (None: fp32, no copy) is the weight as of the last ``start_batch``."""
        for weight, modules in self._modules_by_weight.items():
            if not weight.requires_grad:
                for module in modules:
                    module.weight_grad_sum = None  # a frozen weight: plain nn.Linear, no memory
                continue
            grad_sum, grad = modules[0].weight_grad_sum, weight.grad
            if grad is None:  # cleared (zero_grad): the sum starts again from zero
                if grad_sum is None or grad_sum.device != weight.device:
                    grad_sum = torch.zeros_like(weight, memory_format=torch.contiguous_format)
                else:
                    grad_sum.zero_()
                weight.grad = grad_sum
            elif grad is not grad_sum:  # a .grad of autograd's or someone's own: sum on top of it, as autograd would
                grad_sum = grad if grad.is_contiguous() else grad.contiguous()
                weight.grad = grad_sum
            self._refresh_compute_weight(weight, modules, compute_dtype)
            for module in modules:
                module.weight_grad_sum = grad_sum
        self._recast = False

    def release(self) -> None:
        """Back to plain ``nn.Linear`` behaviour (autograd accumulates ``.grad``) until the next ``prepare``.

        Outside the Trainer nothing would point ``.grad`` at the sums, so an armed layer used in a
        loop of one's own would drop its weight gradients. ``.grad`` keeps the sums' values.
        """
        for modules in self._modules_by_weight.values():
            for module in modules:
                module.weight_grad_sum = module.compute_weight = None
        self._recast = True

    def _refresh_compute_weight(
        self, weight: nn.Parameter, modules: list[AccumulatingLinear], dtype: torch.dtype | None
    ) -> None:
        """Cast the weight once a batch (after ``start_batch``), not once per microbatch."""
        if dtype is None or dtype == weight.dtype:
            for module in modules:
                module.compute_weight = None
            return
        compute_weight = modules[0].compute_weight
        if compute_weight is None or compute_weight.dtype != dtype or compute_weight.device != weight.device:
            compute_weight = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        elif not self._recast:
            return
        with torch.no_grad():
            compute_weight.copy_(weight)
        for module in modules:
            module.compute_weight = compute_weight


def accumulate_weight_grads_in_place(model: nn.Module) -> WeightGradSums:
    """Swap every ``nn.Linear`` (exactly that class: not float8 or LoRA layers) for ``AccumulatingLinear``.

    Only for unsharded models: FSDP2 owns the gradients of the weights it shards. Nothing is
    allocated until ``prepare``; the state dict is unchanged (no new parameters or persistent buffers).
    """
    modules_by_weight: dict[nn.Parameter, list[AccumulatingLinear]] = {}
    for module in model.modules():
        if type(module) is nn.Linear or isinstance(module, AccumulatingLinear):
            module.__class__ = AccumulatingLinear
            if not hasattr(module, "weight_grad_sum"):
                module.weight_grad_sum = None
                module.compute_weight = None
            modules_by_weight.setdefault(module.weight, []).append(module)  # type: ignore[arg-type]
    return WeightGradSums(modules_by_weight)
