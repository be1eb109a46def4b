"""Everything about running on several devices: process groups, FSDP2 sharding, launching ranks.

``env``: rank, world size and the loop's collectives. ``process_group``: join/leave the job.
``placement``: ``parallelize`` applies every parallelism in one place and order; ``mesh`` lays the ranks out;
``protocol``: what a model declares for them. ``launch``: run N local ranks through torchrun (``foundry train
--nproc N``); ``rendezvous``: where several machines meet; ``agreement``: every rank trains the same config.
"""

from __future__ import annotations

from foundry.lazy import lazy_exports

_EXPORTS = {
    "all_gather_object": "foundry.distributed.env",
    "all_reduce_sum": "foundry.distributed.env",
    "all_reduce_sums": "foundry.distributed.env",
    "barrier": "foundry.distributed.env",
    "broadcast_object": "foundry.distributed.env",
    "check_same_config": "foundry.distributed.agreement",
    "default_device": "foundry.distributed.env",
    "destroy_process_group": "foundry.distributed.process_group",
    "explain_lost_ranks": "foundry.distributed.process_group",
    "find_microbatch_size": "foundry.distributed.auto_microbatch",
    "get_local_rank": "foundry.distributed.env",
    "get_local_world_size": "foundry.distributed.env",
    "get_rank": "foundry.distributed.env",
    "get_world_size": "foundry.distributed.env",
    "init_process_group": "foundry.distributed.process_group",
    "is_distributed": "foundry.distributed.env",
    "launched_by_torchrun": "foundry.distributed.job",
    "lost_rank_error": "foundry.distributed.process_group",
    "new_gloo_group": "foundry.distributed.process_group",
    "parallelize": "foundry.distributed.placement",
    "prepare_sharding": "foundry.distributed.placement",
    "set_gradient_sync": "foundry.distributed.fsdp",
    "shards": "foundry.distributed.placement",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
