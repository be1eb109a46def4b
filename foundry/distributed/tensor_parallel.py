"""Tensor parallelism: each block's linears split by column or row over the mesh's ``tp`` axis (Megatron's layout).

The model declares its plan (``TensorParallelModel.tensor_parallel_plan``): which linears split by column (their
outputs, e.g. attention's query/key/value and the FFN's up projection, each rank computing its heads or its
share of the hidden width) and which by row (the projections back to ``d_model``, whose partial sums are
all-reduced), and, with sequence parallelism, where the residual stream between them is split over the sequence
(``SequenceLayout``; norms on each rank's share of the tokens, the row-split sums reduce-scattered). Embeddings
and the output head stay whole on every ``tp`` rank, whose inputs and losses are the same. A LoRA layer splits
with its base (``AdaptedColwiseParallel``, ``AdaptedRowwiseParallel``). The parameters split become DTensors
over ``tp``; FSDP2 then shards them again over its own axes (2-D, torchtitan's ``apply_tp`` before
``apply_fsdp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from foundry.distributed.protocol import TensorParallelModel
from foundry.errors import ConfigError, TrainingError


class FusedColwiseParallel(ParallelStyle):
    """A fused query/key/value projection split by column, each part by its own heads: every rank holds a
    contiguous share of the query's heads and the same share of the key's and the value's, so its query heads
    attend to its own key/value heads (grouped-query attention included) and the layout (and the checkpoint)
    stays the unsplit one. The module computes on its local shares with its own forward (a float8 layer's GEMMs
    too) and returns them side by side, as its caller reads them; backward sums the input's gradient over ``tp``
    (Megatron's column-parallel linear). A LoRA adapter on it (``lora_A``, ``lora_B``) splits with it: ``lora_B``
    as the weight, ``lora_A`` whole on every rank, its gradient summed over ``tp``.

    The parameters become DTensors placed ``_StridedShard(0, split_factor=query_heads_per_kv_head + 2)``:
    the output in units of the key's width, the query's units first. DTensor reads that as equal parts split one
    by one, which is this layout only for multi-head attention (one query unit); nothing here redistributes them
    through DTensor: ``gather_parts`` and ``split_parts_like`` regroup them by hand.
    """

    def __init__(self, query_heads_per_kv_head: int = 1) -> None:
        super().__init__()
        self.units = query_heads_per_kv_head + 2

    def placements(self) -> list[Shard]:
        return [_StridedShard(0, split_factor=self.units)]

    def share(self, whole: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        return _share_of_parts(whole, self.units, 0, rank, ranks)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{type(self).__name__} splits an nn.Linear, not a {type(module).__name__}.")
        adapter = getattr(module, "lora_B", None)
        for owner in (module, adapter) if adapter is not None else (module,):
            self._split_parameters(owner, device_mesh)
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., this rank's share of each part)
            x = _input_gradient_summed(x, group)
            if adapter is None:  # the layer's own forward (float8's GEMMs too) on this rank's share
                with _local_parameters(module):
                    return type(module).forward(module, x)
            # FSDP2 swaps the parameters in and out around forward: read them at call time
            bias = None if module.bias is None else module.bias.to_local()
            out = F.linear(x, module.weight.to_local(), bias)
            # lora_A is whole on every rank, but each rank's share of lora_B sees only its share of the output
            low_rank = F.linear(module.lora_dropout(x), _SumGradient.apply(module.lora_A.weight, group))
            return out + F.linear(low_rank, adapter.weight.to_local()) * module.scaling

        module.forward = forward
        return module

    def _split_parameters(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        # each rank splits its own copy: the same seed built the same weights on every rank (a meta-device
        # model splits meta tensors, which rank 0's weights fill after placement: fill_parts)
        rank, ranks = device_mesh.get_local_rank(), device_mesh.size()
        for name, param in list(module.named_parameters(recurse=False)):
            whole = param.detach()
            sharded = DTensor.from_local(
                self._share_as_whole_is(whole, rank, ranks), device_mesh, self.placements(), run_check=False,
                shape=whole.shape, stride=whole.stride(),
            )  # fmt: skip
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _share_as_whole_is(self, whole: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        """This rank's share; a wrapper subclass's (torchao's weight that FSDP2 all-gathers in float8) wraps the
        share alike, so FSDP2 still gathers it in float8 and its scale still comes from the whole weight."""
        if not is_traceable_wrapper_subclass(whole):
            return self.share(whole, rank, ranks)
        names, context = whole.__tensor_flatten__()
        inner = {name: getattr(whole, name) for name in names}  # the weight, and perhaps a scale it keeps whole
        inner = {name: self.share(t, rank, ranks) if t.shape == whole.shape else t for name, t in inner.items()}
        first = inner[names[0]]
        return type(whole).__tensor_unflatten__(inner, context, first.shape, first.stride())


class AdaptedColwiseParallel(FusedColwiseParallel):
    """A LoRA layer split by column (torch's ``ColwiseParallel`` would split its adapters as linears of their
    own): the weight and ``lora_B`` by output rows, ``lora_A`` whole on every rank."""

    def placements(self) -> list[Shard]:
        return [Shard(0)]

    def share(self, whole: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        return whole.chunk(ranks, dim=0)[rank]


class AdaptedRowwiseParallel(ParallelStyle):
    """A LoRA layer split by row: the weight and ``lora_A`` by input columns, ``lora_B`` whole on every rank. Each
    rank's low-rank product of its share of the input is a part of the whole one, so the adapter's output is
    summed over ``tp`` with the weight's, in one all-reduce (a reduce-scatter over the sequence with
    ``sequence_parallel``); the bias is added after it."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.output_placement = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for owner in (module, module.lora_A):
            weight = owner.weight
            owner.weight = nn.Parameter(
                distribute_tensor(weight.detach(), device_mesh, [Shard(1)]), weight.requires_grad
            )
        group, split_output = device_mesh.get_group(), self.output_placement != Replicate()

        def forward(x: torch.Tensor) -> torch.Tensor:  # (..., this rank's share of d_in) -> (..., d_out)
            partial = F.linear(x, module.weight.to_local())
            low_rank = F.linear(module.lora_dropout(x), module.lora_A.weight.to_local())
            # each rank's low_rank is a part of the sum: so is lora_B's gradient
            partial = partial + F.linear(low_rank, _SumGradient.apply(module.lora_B.weight, group)) * module.scaling
            summed = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False)
            out = summed.redistribute(device_mesh, [self.output_placement]).to_local()
            if module.bias is None:
                return out
            # over a share of the sequence, each rank's bias gradient is a part of the sum
            return out + (_SumGradient.apply(module.bias, group) if split_output else module.bias)

        module.forward = forward
        return module


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """While inside, ``module``'s DTensor parameters read as this rank's shares (their gradients flow back to the
    DTensors); FSDP2 swaps the parameters around forward, so they are read at call time."""
    held = dict(module._parameters)
    module._parameters.update({name: p.to_local() for name, p in held.items() if isinstance(p, DTensor)})
    try:
        yield
    finally:
        module._parameters.update(held)


def _input_gradient_summed(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x as a local tensor whose gradient is summed over ``tp`` (each rank's share of a column-split output holds a
    part of it): by the sequence-parallel all-gather's backward (a reduce-scatter) when x came through one (a
    DTensor, Replicate over tp), else by ``_SumGradient``."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=[Partial()])
    return _SumGradient.apply(x, group)


def _part_sizes(length: int, units: int) -> list[int]:
    """The query's, key's and value's lengths in a fused output of ``length`` rows in ``units`` equal units."""
    unit = length // units
    return [unit * (units - 2), unit, unit]


def _share_of_parts(whole: torch.Tensor, units: int, dim: int, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``whole``: its slice of each of the query, key and value parts, side by side."""
    parts = whole.split(_part_sizes(whole.shape[dim], units), dim=dim)
    return torch.cat([part.chunk(ranks, dim=dim)[rank] for part in parts], dim=dim)


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's share of the output holds a part
    of the input's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SequenceLayout(ParallelStyle):
    """Lays a module's first input out anew over ``tp`` along the sequence (dimension 1), for sequence
    parallelism: ``"split"`` cuts the whole sequence every rank holds into its share (where the residual stream
    enters the blocks; backward all-gathers), ``"gather"`` all-gathers the shares (before attention and the FFN,
    whose backward then reduce-scatters, and before the final norm). ``local_output``: a plain tensor out, else
    a DTensor (which the column-split linears take as it is)."""

    def __init__(self, to: Literal["split", "gather"], local_output: bool) -> None:
        super().__init__()
        self.source, self.target = (Replicate(), Shard(1)) if to == "split" else (Shard(1), Replicate())
        self.split, self.local_output = to == "split", local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def relayout(_module: nn.Module, args: tuple) -> tuple:
            x, *rest = args
            if self.split and x.shape[1] % device_mesh.size():
                raise TrainingError(
                    f"parallelism.sequence_parallel splits each sequence over the {device_mesh.size()} tensor-"
                    f"parallel ranks, but this batch's sequences hold {x.shape[1]} tokens. Pad sequences to a "
                    "multiple of parallelism.tensor_parallel_degree, or set parallelism.sequence_parallel: false."
                )
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.source], run_check=False)
            x = x.redistribute(device_mesh, [self.target])
            return (x.to_local() if self.local_output else x, *rest)

        module.register_forward_pre_hook(relayout)
        return module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Split ``model``'s declared linears over ``tp_mesh`` (and, with ``sequence_parallel``, the residual stream
    between them over the sequence); a model without a plan is refused by name."""
    degree = tp_mesh.size()
    plan = model.tensor_parallel_plan(degree, sequence_parallel) if isinstance(model, TensorParallelModel) else {}
    if not plan:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree is {degree} but {type(model).__name__} declares no tensor-"
            "parallel plan (mpt_causal_lm and llama_causal_lm do). Set the degree to 1."
        )
    for name, style in plan.items():
        module = model.get_submodule(name)
        if (refusal := getattr(module, "tensor_parallel_refusal", None)) is not None:  # a layer TP cannot split
            raise ConfigError(f"'parallelism.tensor_parallel_degree' is {degree} with {refusal}")
        if isinstance(style, SequenceParallel) and not getattr(module, "takes_dtensors", True):
            raise ConfigError(
                f"parallelism.tensor_parallel_degree is {degree} with parallelism.sequence_parallel, which runs "
                f"{name} on DTensors, but it is a {type(module).__name__} (algorithms."
                "fused_kernels' Triton norm), which does not take them yet. Remove fused_kernels (or switch its "
                "rmsnorm and layernorm off), or set parallelism.sequence_parallel: false."
            )
    trainable = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    parallelize_module(model, tp_mesh, plan)
    for name, parameter in model.named_parameters():  # torch's styles make every parameter they place trainable
        parameter.requires_grad_(trainable[name])  # a frozen one (LoRA's base) stays frozen


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


def has_parts(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is split in parts over ``tp`` (``gather_parts`` regroups them)."""
    return any(_split_in_parts(parameter) for parameter in model.parameters())


def _split_in_parts(value: Any) -> bool:
    """Whether ``value`` is split in parts over ``tp`` (FSDP2's own strided shards, over its axes, are not)."""
    return isinstance(value, DTensor) and _strided_axis(value) is not None


@torch.no_grad()
def fill_parts(model: nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Copy each parameter split in parts from rank 0's whole ``weights`` (empty on the other ranks), which DTensor
    would slice as equal parts; returns the other weights, for ``set_model_state_dict``. Every rank calls it."""
    rest = dict(weights)
    for name, parameter in model.state_dict(keep_vars=True).items():  # the names a state dict has
        if not _split_in_parts(parameter):
            continue
        whole = rest.pop(name, None)
        whole = torch.empty(parameter.shape, dtype=parameter.dtype) if whole is None else whole
        whole = whole.to(device, parameter.dtype).contiguous()
        dist.broadcast(whole, src=0)
        mesh = parameter.device_mesh
        for axis, placement in enumerate(parameter.placements):  # this rank's share along each axis
            rank, ranks = mesh.get_local_rank(axis), mesh.size(axis)
            if isinstance(placement, _StridedShard):
                whole = _share_of_parts(whole, placement.split_factor, placement.dim, rank, ranks)
            elif isinstance(placement, Shard):
                whole = whole.chunk(ranks, dim=placement.dim)[rank]
        parameter.to_local().copy_(whole)
    return rest


def gather_parts(state: Any) -> Any:
    """``state`` (a state dict, nested) with each DTensor split in parts gathered over the axis that split it:
    DCP writes and reads each rank's share as one contiguous chunk, which a part-wise split is not. Gathered by
    hand: torch 2.11's DTensor reads ``_StridedShard`` as a shard order and cannot redistribute it."""
    return pytree.tree_map(lambda value: _gathered(value) if _split_in_parts(value) else value, state)


def split_parts_like(state: Any, like: Any) -> Any:
    """``gather_parts``' undoing: each value of ``state`` whose counterpart in ``like`` is split in parts, split so."""
    return pytree.tree_map(lambda value, ref: _split_like(value, ref) if _split_in_parts(ref) else value, state, like)


def _strided_axis(value: DTensor) -> tuple[int, _StridedShard] | None:
    names = value.device_mesh.mesh_dim_names or ()
    strided = [(axis, p) for axis, p in enumerate(value.placements) if isinstance(p, _StridedShard)]
    return next(((axis, p) for axis, p in strided if axis < len(names) and names[axis] == "tp"), None)


def _gathered(value: DTensor) -> DTensor:
    axis, placement = _strided_axis(value)  # type: ignore[misc]
    mesh, dim = value.device_mesh, placement.dim
    local = value.to_local().contiguous()
    shares = [torch.empty_like(local) for _ in range(mesh.size(axis))]
    dist.all_gather(shares, local, group=mesh.get_group(axis))
    # each rank's share is its slice of every part, in order: regroup the slices part by part
    sizes = _part_sizes(local.shape[dim], placement.split_factor)
    pieces = [share.split(sizes, dim=dim)[part] for part in range(len(sizes)) for share in shares]
    whole = torch.cat(pieces, dim=dim)
    placements = [Replicate() if index == axis else p for index, p in enumerate(value.placements)]
    return DTensor.from_local(whole, mesh, placements, run_check=False)


def _split_like(value: DTensor, reference: DTensor) -> DTensor:
    axis, placement = _strided_axis(reference)  # type: ignore[misc]
    mesh = reference.device_mesh
    local = _share_of_parts(
        value.to_local(), placement.split_factor, placement.dim, mesh.get_local_rank(axis), mesh.size(axis)
    )
    return DTensor.from_local(
        local, mesh, reference.placements, run_check=False, shape=reference.shape, stride=reference.stride()
    )


def check_same_batch(batch: Any, tp_group: Any, degree: int) -> None:
    """Refuse a run whose ``tp`` ranks got different batches (a Python user's loader built without
    ``replication``): each rank would train the same weights on other samples and the split layers would mix them.
    One small all-gather of a fingerprint (elements, the sum of the values and their position-weighted sum)."""
    leaves = [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        return
    device = leaves[0].device
    fingerprint = torch.zeros(3, dtype=torch.float64, device=device)
    for leaf in leaves:
        values = leaf.detach().reshape(-1).to(device=device, dtype=torch.float64)
        positions = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=device)
        fingerprint[0] += values.numel()
        fingerprint[1] += values.sum()
        fingerprint[2] += values @ positions
    gathered = [torch.empty_like(fingerprint) for _ in range(degree)]
    dist.all_gather(gathered, fingerprint, group=tp_group)
    if all(torch.equal(gathered[0], other) for other in gathered[1:]):
        return
    raise ConfigError(
        f"parallelism.tensor_parallel_degree is {degree}, but the {degree} tensor-parallel ranks of a group got "
        "different batches on their first step; they split each layer between them, so they must load the same "
        "samples. "
        f"Build the train loader so that each {degree} consecutive ranks load the same rows: foundry's text and "
        f"finetuning loaders take replication={degree}; a loader of your own shards over "
        "state.parallel_dims.sample_ranks ranks, this rank being sample_rank(rank) (docs/DISTRIBUTED.md)."
    )
