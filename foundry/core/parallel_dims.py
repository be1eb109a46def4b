"""The degree of each axis the job's ranks are laid out on: pure numbers, known before any process group.

``foundry.distributed.mesh`` computes them (``parallel_dims``) and builds the DeviceMesh from them; the run
keeps both on its State, so loaders, reductions and throughput ask how many ranks share what.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The degree of each axis of ``foundry.distributed.mesh.AXES``; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1  # tensor parallelism: ranks that split each linear and see the same samples
    ep: int = 1  # over the data-parallel ranks, not a factor of the world size

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def sample_ranks(self) -> int:
        """How many ranks load different samples: the data loaders' world. Context-parallel ranks load their own
        and pool them within ``cp`` (``ContextParallel.shard``), so they count; tensor-parallel ranks must see the
        same samples, so ``tp`` does not."""
        return self.dp_replicate * self.dp_shard * self.cp

    def sample_rank(self, rank: int) -> int:
        """The data loaders' rank of global ``rank`` (ranks are laid out row-major over ``AXES``, ``tp`` innermost,
        so the ``tp`` ranks in a row share one)."""
        return rank // self.tp

    @property
    def loss_ranks(self) -> int:
        """How many ranks each hold a share of a batch's loss and gradients: what reductions divide by.
        Tensor-parallel ranks hold the same loss, not a share of it."""
        return self.dp_replicate * self.dp_shard * self.cp
