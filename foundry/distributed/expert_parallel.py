"""Expert parallelism: each rank of an ``ep`` mesh axis holds ``num_experts / ep`` of every MoE layer's experts.

``apply_expert_parallel(model, ep_mesh)`` shards each MoE layer's stacked expert weights along the
expert dimension (DTensors ``Shard(0)`` on ``ep_mesh``, so distributed checkpoints hold the global
tensors and reload at any other expert-parallel degree) and swaps the experts' ``route`` for an
exchange between the ranks:

1. each rank sorts its (token, expert) assignments by expert, so the rows bound for each rank are
   contiguous, and the ranks exchange how many rows go where (a small all-to-all);
2. dispatch: an all-to-all sends every row to the rank holding its expert;
3. each rank runs its experts on what it received (regrouped by local expert, grouped GEMMs);
4. combine: the reverse all-to-all returns the outputs, and each token sums its experts' outputs
   with its router weights.

Both all-to-alls are torch's autograd-aware functional collectives: backward exchanges the
gradients the same way. Routing stays on every rank (the router is replicated), and the load
metrics and loss terms count this rank's tokens, as data parallelism does.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from foundry.errors import ConfigError
from foundry.models.experts import GroupedExperts, combine, dispatch, sort_by_expert
from foundry.models.moe import moe_layers


class ExpertParallelExperts(GroupedExperts):
    """``GroupedExperts`` whose weights hold this rank's experts and whose tokens travel by all-to-all."""

    ep_mesh: DeviceMesh

    def route(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        layout = sort_by_expert(expert_ids, self.num_experts)  # rows grouped by expert, so by destination rank
        tokens_per_expert = layout.tokens_per_expert
        # received[source, local expert]: rows each rank sends for each of this rank's experts
        received = funcol.all_to_all_single(tokens_per_expert, None, None, group=group)
        received = funcol.wait_tensor(received).view(ep, -1)
        send_splits = tokens_per_expert.view(ep, -1).sum(1).tolist()  # host sync: the exchange's sizes
        receive_splits = received.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(dispatch(x, layout), receive_splits, send_splits, group)
        local_experts = received.shape[1]
        # rows arrive by source rank, then by local expert: regroup them by local expert for the GEMMs
        local_ids = torch.arange(local_experts, device=x.device).repeat(ep).repeat_interleave(received.flatten())
        local_layout = sort_by_expert(local_ids[:, None], local_experts, self.row_alignment(rows))
        ones = torch.ones(rows.shape[0], 1, device=x.device)
        outputs = combine(self(dispatch(rows, local_layout), local_layout), local_layout, ones)
        returned = funcol.all_to_all_single_autograd(outputs, send_splits, receive_splits, group)
        return combine(returned, layout, weights), tokens_per_expert


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every MoE layer of ``model`` over the 1-D ``ep_mesh``; returns how many layers were sharded.

    The expert weights must hold the same values on every rank of ``ep_mesh`` (a seeded CPU build, or
    weights loaded afterwards through a distributed checkpoint).
    """
    layers = moe_layers(model)
    ep = ep_mesh.size()
    for layer in layers:
        experts = layer.experts
        if experts.num_experts % ep:
            raise ConfigError(
                f"Expert parallelism over {ep} ranks splits each MoE layer's {experts.num_experts} experts evenly; "
                "choose an expert-parallel degree that divides the number of experts."
            )
        for name, parameter in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(parameter.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_mesh = ep_mesh
    return len(layers)
