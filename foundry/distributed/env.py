"""Rank and world size from torch.distributed (or torchrun's environment) and the few collectives the loop needs."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", 0))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_world_size() -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, else every rank (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", get_world_size()))


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` (None: all) in place (a no-op in one process); no host sync."""
    if is_distributed() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_sums(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Each of ``tensors`` (one device) summed over ``group``'s ranks (None: all), in one all-reduce; no host sync.

    They travel as one float64 vector and come back in their own dtypes and shapes: integer counts stay
    exact up to 2**53, and each float32 sum is rounded to float32 once (on two ranks, bit for bit what a
    float32 all-reduce gives; on more, at least as close to the exact sum as a float32 ring is).
    """
    if not tensors or not (is_distributed() and get_world_size() > 1):
        return list(tensors)
    summed = all_reduce_sum(torch.cat([tensor.detach().reshape(-1).double() for tensor in tensors]), group)
    pieces = summed.split([tensor.numel() for tensor in tensors])
    return [piece.reshape(tensor.shape).to(tensor.dtype) for piece, tensor in zip(pieces, tensors)]


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (picklable objects; ``value`` itself in one process)."""
    if not is_distributed() or get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` in ``group`` (None: all), in rank order (picklable objects; ``[value]`` in one
    process)."""
    if not is_distributed() or get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def default_device() -> torch.device:
    """This rank's accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank())
    return torch.device("cpu")
