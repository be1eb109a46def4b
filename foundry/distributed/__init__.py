"""Everything about running on several devices: process groups, FSDP2 sharding, launching ranks.

``env``: rank, world size and the loop's collectives. ``process_group``: join/leave the job.
``parallelize``: FSDP2 and activation checkpointing, applied in one place. ``launch``: run N local
ranks through torchrun (``foundry train --nproc N``).
"""

from foundry.distributed.auto_microbatch import find_microbatch_size
from foundry.distributed.env import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    default_device,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_world_size,
    is_distributed,
)
from foundry.distributed.parallelize import parallelize, prepare_sharding, set_gradient_sync, shards
from foundry.distributed.process_group import (
    destroy_process_group,
    explain_lost_ranks,
    init_process_group,
    launched_by_torchrun,
    lost_rank_error,
    new_gloo_group,
)

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "default_device",
    "destroy_process_group",
    "explain_lost_ranks",
    "find_microbatch_size",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_distributed",
    "launched_by_torchrun",
    "lost_rank_error",
    "new_gloo_group",
    "parallelize",
    "prepare_sharding",
    "set_gradient_sync",
    "shards",
]
