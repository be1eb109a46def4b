"""Numeric precision of the run: which autocast context wraps forward and loss."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from foundry.errors import ConfigError

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")


def check_precision(precision: str, device: torch.device) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision is {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    if precision == "amp_fp16" and device.type != "cuda":
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
    dtype = torch.bfloat16 if precision == "amp_bf16" else torch.float16
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type``, or None outside autocast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
