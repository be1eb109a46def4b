"""Tensor parallelism: each block's linears split by column or row over the mesh's ``tp`` axis (Megatron's layout).

The model declares its plan (``ParallelModel.tensor_parallel_plan``): which linears split by column (their
outputs, e.g. attention's query/key/value and the FFN's up projection, each rank computing its heads or its
share of the hidden width) and which by row (the projections back to ``d_model``, whose partial sums are
all-reduced). Everything outside the plan (embeddings, norms, the output head) stays whole on every ``tp`` rank,
whose inputs, activations between blocks and losses are the same. The parameters split become DTensors over
``tp``; FSDP2 then shards them again over its own axes (2-D, torchtitan's ``apply_tp`` before ``apply_fsdp``).
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from foundry.distributed.protocol import TensorParallelModel
from foundry.errors import ConfigError


class FusedColwiseParallel(ColwiseParallel):
    """A linear whose output concatenates ``parts`` equal-width parts (a fused query/key/value projection), each
    split by column on its own: every rank holds its share of each part, so the layout (and the checkpoint) stays
    the unsplit one. The output stays local (``parts`` shares side by side), as its module reads it."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = [_StridedShard(0, split_factor=self.parts)]
        for param_name, param in module.named_parameters():
            sharded = distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        return outputs.to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split ``model``'s declared linears over ``tp_mesh``; a model without a plan is refused by name."""
    plan = model.tensor_parallel_plan(tp_mesh.size()) if isinstance(model, TensorParallelModel) else {}
    if not plan:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree is {tp_mesh.size()} but {type(model).__name__} declares no tensor-"
            "parallel plan (mpt_causal_lm and llama_causal_lm do). Set the degree to 1."
        )
    parallelize_module(model, tp_mesh, plan)


def check_fsdp_shards_compose(model: nn.Module, fsdp_ranks: int) -> None:
    """A vector split in parts (a fused Wqkv's bias) has no second dimension for FSDP2 to shard, and DTensor gathers
    it wrongly when sharded again along its only one: refused when FSDP2 shards over several ranks."""
    if fsdp_ranks == 1:
        return
    for name, parameter in model.named_parameters():
        if parameter.ndim == 1 and _split_in_parts(parameter):
            raise ConfigError(
                f"parallelism.tensor_parallel_degree splits {name} (a fused projection's bias) in parts, which FSDP2 "
                f"cannot shard again over its {fsdp_ranks} ranks yet. Train without biases (model.no_bias: true), "
                "shard over one rank per tensor-parallel group (as many ranks as the degree), or use "
                "sharding_strategy NO_SHARD."
            )


def fsdp_shard_placement(parameter: nn.Parameter) -> Shard | None:
    """Where FSDP2 shards ``parameter`` beside ``tp``: a weight split in parts (``FusedColwiseParallel``) along its
    input dimension, since DTensor cannot gather a part-wise split sharded again along the same dimension; None
    (dimension 0) for the rest."""
    return Shard(1) if parameter.ndim == 2 and _split_in_parts(parameter) else None


def _split_in_parts(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def gather_parts(state: Any) -> Any:
    """``state`` (a state dict, nested) with each DTensor split in parts gathered over the axis that split it:
    DCP writes and reads each rank's share as one contiguous chunk, which a part-wise split is not."""

    def gathered(value: Any) -> Any:
        if not _split_in_parts(value):
            return value
        placements = [Replicate() if isinstance(p, _StridedShard) else p for p in value.placements]
        return value.redistribute(placements=placements)

    return pytree.tree_map(gathered, state)


def split_parts_like(state: Any, like: Any) -> Any:
    """``gather_parts``' undoing: each value of ``state`` whose counterpart in ``like`` is split in parts, split so."""

    def split(value: Any, reference: Any) -> Any:
        return value.redistribute(placements=reference.placements) if _split_in_parts(reference) else value

    return pytree.tree_map(split, state, like)
