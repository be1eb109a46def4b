"""Batches of any nesting (tensors, mappings, lists/tuples of them): moved to the device, split into microbatches;
eval samples that several ranks hold counted once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from foundry import distributed
from foundry.targets import IGNORE_INDEX

SAMPLE_INDEX_KEY = "sample_index"  # (batch,) each sample's index in its dataset, from loaders that tag them


def batch_num_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_num_samples(next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        return batch_num_samples(batch[0])
    raise TypeError(f"Cannot count samples in a batch of type {type(batch).__name__}.")


def batch_num_tokens(batch: Any) -> int:
    """Tokens in a batch (padding included; no host sync): ``input_ids.numel()``, else samples."""
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return batch_num_samples(batch)


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


class RepeatedSampleMask:
    """Evaluation counts each sample once, whatever the number of ranks.

    A loader that spreads N samples over W ranks gives every rank the same number, repeating a few
    samples when W does not divide N (mosaicml-streaming does); counted twice, they would make the
    eval loss depend on the world size. For batches that carry ``SAMPLE_INDEX_KEY`` (the ``text``
    loader's eval loaders), the ranks share the batch's indices (one small all-gather) and a sample
    that an earlier batch, a lower rank or an earlier row already holds gets its labels set to
    ``IGNORE_INDEX``: it still runs, so every rank runs the same forwards, but adds no loss and no
    weight. Every rank calls it once per eval batch, the same number of times.

    ``group``: the ranks that load different samples and sum the loss (the mesh's loss group; None: every
    rank). Tensor-parallel ranks load the same samples: each counts them, in its own loss group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.seen: set[int] = set()
        self.group = group

    def __call__(self, batch: Any) -> Any:
        """``batch`` without ``SAMPLE_INDEX_KEY``, its repeated samples' labels ignored."""
        if not isinstance(batch, Mapping) or SAMPLE_INDEX_KEY not in batch:
            return batch
        batch = dict(batch)
        indices = batch.pop(SAMPLE_INDEX_KEY).tolist()
        every_rank = distributed.all_gather_object(indices, self.group)
        rank = dist.get_rank(self.group) if distributed.is_distributed() else 0
        counted = set(self.seen)
        for lower_rank in every_rank[:rank]:
            counted.update(lower_rank)
        repeated = []
        for row, index in enumerate(indices):
            if index in counted:
                repeated.append(row)
            counted.add(index)
        self.seen.update(index for rank_indices in every_rank for index in rank_indices)
        if repeated:
            batch["labels"] = _labels(batch).index_fill(0, torch.tensor(repeated), IGNORE_INDEX)
        return batch


def _labels(batch: Mapping[str, Any]) -> torch.Tensor:
    """The batch's labels: given ones, or its input ids with padding (attention_mask 0) ignored."""
    if batch.get("labels") is not None:
        return batch["labels"]
    labels = batch["input_ids"]
    attention_mask = batch.get("attention_mask")
    return labels.masked_fill(attention_mask == 0, IGNORE_INDEX) if attention_mask is not None else labels.clone()
