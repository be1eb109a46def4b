"""Batches of any nesting (tensors, mappings, lists/tuples of them): moved to the device, split into microbatches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from foundry.models.base import batch_num_samples


def split_batch(batch: Any, microbatch_size: int | None) -> list[Any]:
    """Split a batch along dim 0 into microbatches of ``microbatch_size`` samples (the last may be smaller)."""
    size = batch_num_samples(batch)
    if not microbatch_size or microbatch_size >= size:
        return [batch]
    starts = range(0, size, microbatch_size)
    return [_slice(batch, start, start + microbatch_size) for start in starts]


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, Mapping):
        return {key: _slice(value, start, end) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_slice(value, start, end) for value in batch) if _has_tensor(batch) else batch[start:end]
    return batch


def _has_tensor(values: Sequence[Any]) -> bool:
    return any(isinstance(value, torch.Tensor | Mapping) for value in values)


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` to ``device`` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: batch_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(batch_to_device(value, device) for value in batch)
    return batch
