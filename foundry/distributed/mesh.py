"""How the job's ranks divide the work: one DeviceMesh whose axes are named, built in one place.

The axes, outermost first (torchtitan's names):

- ``dp_replicate``: copies of the whole sharded model (HYBRID_SHARD across nodes, NO_SHARD);
- ``dp_shard``: ranks that shard parameters and see different samples;
- ``cp``: ranks that split each sequence along its length (context parallelism);
- ``tp``: ranks that split each linear layer by rows or columns and see the same samples (tensor parallelism,
  innermost: its collectives run every layer, so its ranks sit on one node).

Two flattened axes serve the components: ``dp_shard_cp`` is what FSDP2 shards over (context-parallel
ranks hold different tokens, so they can hold different shards too), and ``dp`` is the ranks that see
different samples. ``ep`` (expert parallelism) borrows the data-parallel ranks, as torchtitan's does: each
MoE layer's experts split over them while FSDP2 shards the rest over the same ranks. FSDP2 shards over the
same axes with tensor parallelism as without: parameters split by ``tp`` are sharded again over ``fsdp``
(2-D). A new axis is one more degree in ``ParallelDims`` and one more name in ``AXES``; callers ask the mesh
for the axes they use and stay unchanged.
"""

from __future__ import annotations

import dataclasses

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from foundry.core.parallel_dims import ParallelDims
from foundry.distributed.config import ParallelismConfig, check_parallelism
from foundry.distributed.env import get_local_world_size, get_world_size
from foundry.errors import ConfigError

AXES = ("dp_replicate", "dp_shard", "cp", "tp")  # ParallelDims' degrees, outermost first


@dataclasses.dataclass(frozen=True)
class JobMesh:
    """The world's DeviceMesh and its flattened axes; ``mesh[name]`` gives any axis by name."""

    world: DeviceMesh
    dp_shard_cp: DeviceMesh  # what FSDP2 shards over
    dp: DeviceMesh  # data-parallel ranks: once context parallelism pools its ranks' samples, each holds its own
    ep: DeviceMesh | None = None  # the ranks each MoE layer's experts split over; None: no expert parallelism
    # The group a batch's loss, weights and metrics are summed over: every axis but ``tp`` holds a share (different
    # samples, or different tokens of them); ``tp`` ranks hold the same loss. None: the whole world, the default group.
    loss_group: ProcessGroup | None = None

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.world[name] if name in AXES else getattr(self, name)

    @property
    def fsdp(self) -> DeviceMesh:
        """What FSDP2 shards over: ``dp_shard_cp``, with ``dp_replicate`` outside it when there are copies (HSDP)."""
        if self.world["dp_replicate"].size() == 1:
            return self.dp_shard_cp
        if self.world["cp"].size() == 1:
            return self.world["dp_replicate", "dp_shard"]
        return self.world["dp_replicate", "dp_shard_cp"]  # HSDP across nodes with cp inside each


def build_mesh(dims: ParallelDims, device_type: str) -> JobMesh:
    """The world's mesh with every axis of ``AXES`` (size-1 ones included) and the flattened ones."""
    shape = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
    # torch asks callers to keep the flattened meshes rather than slice them from the world's again
    dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    ep = world["dp_replicate", "dp_shard"]._flatten("ep") if dims.ep > 1 else None
    loss = world["dp_replicate", "dp_shard", "cp"]._flatten("loss").get_group() if dims.tp > 1 else None
    return JobMesh(world, dp_shard_cp=dp_shard_cp, dp=dp, ep=ep, loss_group=loss)


def parallel_dims(layout: str, parallelism: ParallelismConfig) -> ParallelDims:
    """The degrees for ``fsdp_config``'s rank layout (shard, hybrid, replicate) and ``parallelism``'s degrees.

    ``hybrid`` shards within a node and replicates across nodes, ``replicate`` gives every data-parallel
    rank the whole model; context- and tensor-parallel ranks always share the shards (they sit inside a node).
    """
    world_size, cp, tp = get_world_size(), parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
    check_parallelism(parallelism, world_size)
    data_parallel = world_size // (cp * tp)
    ep = parallelism.expert_parallel_degree
    if layout == "replicate":
        return ParallelDims(dp_replicate=data_parallel, cp=cp, tp=tp, ep=ep)
    if layout == "hybrid":
        ranks_per_node = get_local_world_size()
        if world_size % ranks_per_node or ranks_per_node % (cp * tp):
            raise ConfigError(
                f"fsdp_config.sharding_strategy HYBRID_SHARD shards within a node, but the {world_size} ranks do not "
                f"split into nodes of LOCAL_WORLD_SIZE={ranks_per_node} (each a multiple of "
                f"parallelism.context_parallel_degree={cp} x tensor_parallel_degree={tp}). Launch the same number of "
                "ranks per node."
            )
        if world_size > 1 and world_size == ranks_per_node:
            raise ConfigError(
                f"fsdp_config.sharding_strategy HYBRID_SHARD shards within a node and replicates across nodes, but all "
                f"{world_size} ranks are on one node (LOCAL_WORLD_SIZE={ranks_per_node}), where it would be FULL_SHARD "
                "(_HYBRID_SHARD_ZERO2: SHARD_GRAD_OP). Set sharding_strategy: FULL_SHARD (or SHARD_GRAD_OP), or launch "
                "on several nodes (foundry train --nnodes N)."
            )
        return ParallelDims(
            dp_replicate=world_size // ranks_per_node, dp_shard=ranks_per_node // (cp * tp), cp=cp, tp=tp, ep=ep
        )
    return ParallelDims(dp_shard=data_parallel, cp=cp, tp=tp, ep=ep)
