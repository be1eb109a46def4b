"""Expert parallelism: each rank of an ``ep`` mesh axis holds ``num_experts / ep`` of every MoE layer's experts.

``apply_expert_parallel(layers, ep_mesh)`` shards each MoE layer's stacked expert weights along the
expert dimension (DTensors ``Shard(0)`` on ``ep_mesh``, so distributed checkpoints hold the global
tensors and reload at any other expert-parallel degree) and gives each layer an ``exchange`` between the
ranks, through which its ``route`` sends rows:

1. each rank sorts its (token, expert) assignments by expert, so the rows bound for each rank are
   contiguous, and the ranks exchange how many rows go where (a small all-to-all);
2. dispatch: an all-to-all sends every row to the rank holding its expert;
3. each rank runs its experts on what it received (regrouped by local expert, grouped GEMMs);
4. combine: the reverse all-to-all returns the outputs, and each token sums its experts' outputs.
   The router weights travel with the rows (a third, small all-to-all) and scale them on the experts'
   rank, inside the experts' elementwise activation, as on one rank.

Both all-to-alls are torch's autograd-aware functional collectives: backward exchanges the
gradients the same way. Routing stays on every rank (the router is replicated), and the load
metrics and loss terms count this rank's tokens, as data parallelism does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from foundry.distributed.config import check_experts_divide
from foundry.distributed.env import get_world_size
from foundry.distributed.protocol import ExpertLayer, expert_layers_of
from foundry.errors import ConfigError


class AllToAllExchange:
    """An expert layer's ``exchange`` (``foundry.distributed.protocol.ExpertExchange``) under expert parallelism:
    its weights hold this rank's experts, and its tokens travel by all-to-all over ``ep_mesh``. The layer's own
    ``sort_by_expert``, ``dispatch``, ``undo_sort``, ``combine`` and ``slot_weights`` lay the rows out."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.ep_mesh = ep_mesh

    def route(
        self, experts: ExpertLayer, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sort_by_expert, dispatch, undo_sort, combine = (
            experts.sort_by_expert, experts.dispatch, experts.undo_sort, experts.combine
        )  # fmt: skip
        slot_weights = experts.slot_weights
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        layout = sort_by_expert(expert_ids, experts.num_experts)  # rows grouped by expert, so by destination rank
        tokens_per_expert = layout.tokens_per_expert
        # received[source, local expert]: rows each rank sends for each of this rank's experts
        received = funcol.all_to_all_single(tokens_per_expert, None, None, group=group)
        received = funcol.wait_tensor(received).view(ep, -1)
        # The exchange's sizes must reach the host: one read for both, the layer's only device sync.
        sizes = torch.stack([tokens_per_expert.view(ep, -1).sum(1), received.sum(1)])
        send_splits, receive_splits = sizes.tolist()
        rows = funcol.all_to_all_single_autograd(dispatch(x, layout), receive_splits, send_splits, group)
        row_weights = funcol.all_to_all_single_autograd(
            slot_weights(weights, layout), receive_splits, send_splits, group
        )
        local_experts = received.shape[1]
        # rows arrive by source rank, then by local expert: regroup them by local expert for the GEMMs
        local_ids = torch.arange(local_experts, device=x.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(received.flatten(), output_size=rows.shape[0])  # size known: no sync
        local_layout = sort_by_expert(local_ids[:, None], local_experts, experts.row_alignment(rows))
        local_weights = dispatch(row_weights.unsqueeze(1), local_layout).squeeze(1)
        outputs = undo_sort(experts(dispatch(rows, local_layout), local_layout, local_weights), local_layout)
        returned = funcol.all_to_all_single_autograd(outputs, send_splits, receive_splits, group)
        return combine(returned, layout), tokens_per_expert


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh | None) -> set[nn.Parameter]:
    """``parallelism.expert_parallel_degree``: the experts split over the mesh's ``ep`` axis; their parameters.

    FSDP2 shards every other parameter over the same ranks and ignores these: each expert lives on one
    rank, and its gradient already sums every rank's tokens (the all-to-all's backward), so it is only
    divided by the number of ranks, as FSDP's reduction averages the others.
    """
    if ep_mesh is None:
        return set()
    world_size = get_world_size()  # the ep axis spans every rank (foundry.distributed.mesh checks it)
    layers = expert_layers_of(model)
    if not apply_expert_parallel(layers, ep_mesh):
        raise ConfigError(
            f"parallelism.expert_parallel_degree is {ep_mesh.size()} but the model has no mixture-of-experts layers; "
            "remove the key."
        )
    params = {param for experts in layers for param in experts.parameters()}
    for param in params:
        param.register_hook(lambda grad: grad / world_size)
    return params


def apply_expert_parallel(layers: Sequence[ExpertLayer], ep_mesh: DeviceMesh) -> int:
    """Shard every expert layer of ``layers`` over the 1-D ``ep_mesh``; returns how many layers were sharded.

    The expert weights must hold the same values on every rank of ``ep_mesh`` (a seeded CPU build, or
    weights loaded afterwards through a distributed checkpoint).
    """
    ep = ep_mesh.size()
    for experts in layers:
        check_experts_divide(ep, experts.num_experts)
        for name, parameter in list(experts.named_parameters(recurse=False)):
            # This rank's experts, sliced where the weights are (a full copy never reaches the device), then moved
            local = parameter.data.chunk(ep)[ep_mesh.get_local_rank()]
            local = local if local.is_meta else local.to(ep_mesh.device_type).contiguous()
            shape, stride = parameter.shape, parameter.stride()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        experts.exchange = AllToAllExchange(ep_mesh)
    return len(layers)
