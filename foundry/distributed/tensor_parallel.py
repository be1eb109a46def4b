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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
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
