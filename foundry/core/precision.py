"""Numeric precision of the run: which autocast context wraps forward and loss."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from foundry.core.precision_name import PRECISIONS, Precision
from foundry.errors import ConfigError


def check_precision(precision: str | Precision, device: torch.device) -> Precision:
    """The ``Precision`` a run on ``device`` computes in: ``auto`` becomes amp_bf16 on a GPU and fp32 elsewhere;
    a name foundry does not know, or one ``device`` cannot run, is refused.

    ``auto`` is fp32 on a CPU because bf16 autocast there is an order of magnitude slower than fp32 on
    most CPUs (no bf16 matmul units): a tiny MPT's batch takes minutes instead of seconds.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision is {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    precision = Precision(precision)
    if precision == Precision.AUTO:
        return Precision.AMP_BF16 if device.type == "cuda" else Precision.FP32
    if precision == Precision.AMP_FP16 and device.type != "cuda":
        raise ConfigError(
            f"precision 'amp_fp16' needs a CUDA device (this run is on {device.type}); use 'amp_bf16' or 'fp32'."
        )
    return precision


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """bf16/fp16 autocast for the amp precisions; parameters and optimizer state stay fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=compute_dtype(precision)):
        yield


def compute_dtype(precision: str | Precision) -> torch.dtype | None:
    """The dtype the amp precisions compute in; None for fp32."""
    return {Precision.AMP_BF16: torch.bfloat16, Precision.AMP_FP16: torch.float16}.get(Precision(precision))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type``, or None outside autocast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def cast_embeddings_to_autocast_dtype(model: nn.Module) -> int:
    """Hook every ``nn.Embedding`` in ``model`` (once) so its output is in the autocast dtype; returns how many.

    Under autocast with fp32 parameters an embedding lookup returns fp32, so every residual add after
    it promotes to fp32. FSDP's bf16 ``param_dtype`` makes the lookup, and with it the residual stream,
    bf16; this hook gives an unsharded model the same activation precision. Outside autocast it does nothing.
    """
    hooked = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            if _to_autocast_dtype not in module._forward_hooks.values():
                module.register_forward_hook(_to_autocast_dtype)
            hooked += 1
    return hooked


def _to_autocast_dtype(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    dtype = autocast_dtype(output.device.type)
    return output if dtype is None or not output.is_floating_point() else output.to(dtype)


def grad_scaler(precision: str, sharded: bool) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; sharded, every rank must agree on skipping a step with inf gradients."""
    if precision != "amp_fp16":
        return None
    if sharded:
        return ShardedGradScaler("cuda")
    return torch.amp.GradScaler("cuda")
