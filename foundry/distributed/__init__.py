"""Process groups, ranks and (later) sharding: everything about running on several devices."""

from foundry.distributed.env import (
    all_reduce_sum,
    barrier,
    default_device,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
)

__all__ = [
    "all_reduce_sum",
    "barrier",
    "default_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_distributed",
]
