"""``foundry train CFG.yaml --dry-run --world-size N``: a job's layout planned on a CPU, without its GPUs.

torch's fake process group (torchtitan's ``COMM_MODE=fake_backend``) stands in for N ranks in this one
process, as rank 0: the job's mesh is built, the model is built on the meta device and placed by the same
``place_model`` a run calls (the mesh, context and expert parallelism, activation checkpointing, FSDP2),
and no weight is ever allocated. Read from the placed model, per GPU:

- parameters, gradients and optimizer state: the local shards' sizes as stored (fp32; a LoRA base in
  ``peft_config.base_dtype`` or 4-bit NF4), gradients and optimizer state of the trainable parameters
  alone (LoRA: the adapters; the moments in ``optimizer.moments_dtype``);
- the gathered working set: FSDP2's units in the compute dtype (NF4 weights in 4 bits), with the unsharded
  gradients of their trainable parameters: the root
  and two blocks (one running, one prefetched), or the whole model where it stays gathered between
  microbatches (``model_is_small_for`` the ``--gpu-memory-gib`` card);
- activations: ``foundry.models.activations`` for one microbatch.

The collectives of one step are derived from the same placement (which modules are FSDP2 units and their
sizes, the schedule between microbatches, the context- and expert-parallel layers), not recorded from a fake
step: a step on meta tensors would need every kernel it reaches (attention, the fused loss, grouped GEMMs) to
run on meta, and would record the schedule a CPU takes rather than the GPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

from foundry.config import TrainConfig
from foundry.config.build import check_settings, device_train_batch_size
from foundry.core.precision import compute_dtype
from foundry.distributed.activation_checkpoint import checkpoint_plan
from foundry.distributed.config import FSDPConfig
from foundry.distributed.fsdp import STRATEGIES, mixed_precision_policy, model_is_small_for
from foundry.distributed.placement import job_layout, place_model
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError
from foundry.models.activations import ActivationPlan, BlockShape, activation_bytes
from foundry.models.build import build_model
from foundry.models.nf4 import is_nf4, stored_bytes

GIB = 1 << 30
PLANNED_MODELS = ("mpt_causal_lm", "llama_causal_lm")
# state tensors the size of each parameter, by optimizer name (Adam's two moments, Lion's one)
OPTIMIZER_STATES = {"decoupled_adamw": 2, "adamw": 2, "decoupled_lionw": 1, "sgd": 0}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: how often it runs and the bytes of the tensors it moves (the gathered
    output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce, the rows an all-to-all
    sends)."""

    op: str
    what: str
    over: str  # the mesh axis and its size
    calls_per_step: int
    bytes_per_step: int


@dataclasses.dataclass(frozen=True)
class DryRunPlan:
    """What each GPU of the job holds at its peak, and what a step sends between them."""

    world_size: int
    ranks_per_node: int
    mesh: dict[str, int]  # axis -> degree
    parameters: int  # the model's, each shared one once
    fsdp_units: int
    checkpointed_blocks: int
    blocks: int
    microbatches_per_step: int
    tokens_per_microbatch: int  # a GPU's
    kept_gathered: bool  # FSDP's units stay gathered between a step's microbatches
    memory_bytes: dict[str, int]  # per GPU: parameters, gradients, optimizer, gathered, activations
    collectives: list[Collective]
    # activations a GPU with the first k blocks checkpointed whole, k = 0 .. blocks (activation_checkpointing: auto)
    activation_bytes_by_checkpointed: tuple[int, ...] = ()
    block_class: str = ""  # what model.activation_checkpointing_target calls a block

    @property
    def total_bytes(self) -> int:
        return sum(self.memory_bytes.values())

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "total_bytes": self.total_bytes}, indent=1)

    def table(self) -> str:
        nodes = self.world_size // self.ranks_per_node
        mesh = " × ".join(f"{axis} {degree}" for axis, degree in self.mesh.items())
        schedule = "are kept gathered, reduced once a step" if self.kept_gathered else "are resharded every microbatch"
        if self.fsdp_units == 0:
            schedule = "none: one GPU"
        lines = [
            f"dry run: {self.world_size} ranks ({nodes} node{'s' * (nodes > 1)} of {self.ranks_per_node}) on torch's "
            "fake process group; the model on the meta device",
            f"mesh: {mesh}",
            f"model: {_count(self.parameters)} parameters in {self.fsdp_units} FSDP units; "
            f"{self.checkpointed_blocks} of {self.blocks} blocks checkpointed",
            f"step: {self.microbatches_per_step} microbatch{'es' * (self.microbatches_per_step > 1)} of "
            f"{self.tokens_per_microbatch:,} tokens a GPU; FSDP's units {schedule}",
            "",
            f"{'per GPU':<28}{'GiB':>10}",
        ]
        lines += [f"  {name:<26}{size / GIB:>10.2f}" for name, size in self.memory_bytes.items()]
        lines += [f"  {'total':<26}{self.total_bytes / GIB:>10.2f}", ""]
        lines.append(f"{'collectives per step':<52}{'over':<22}{'calls':>8}{'GiB':>10}")
        for c in self.collectives:
            lines.append(f"  {c.op + ' ' + c.what:<50}{c.over:<22}{c.calls_per_step:>8}{c.bytes_per_step / GIB:>10.2f}")
        if not self.collectives:
            lines.append("  none (one rank)")
        return "\n".join(lines)


def dry_run(cfg: TrainConfig, world_size: int, ranks_per_node: int = 8, device_memory_gib: float = 80.0) -> DryRunPlan:
    """Plan ``cfg`` on ``world_size`` GPUs, ``ranks_per_node`` a node, each of ``device_memory_gib``.

    Raises:
        ConfigError: a world size the mesh or the global batch cannot divide, or a model it cannot plan.
    """
    ranks_per_node = min(ranks_per_node, world_size)
    _check_world(world_size, ranks_per_node)
    check_settings(cfg, world_size)  # the parallel degrees against the world size and the model
    if cfg.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            f"'parallelism.tensor_parallel_degree' is {cfg.parallelism.tensor_parallel_degree}; the dry run does not "
            "plan tensor parallelism yet (its memory and collectives). Plan the layout with the degree at 1."
        )
    device_batch = device_train_batch_size(cfg.global_train_batch_size, world_size)
    model = _meta_model(cfg.model)
    block_class = type(blocks_of(model)[0]).__name__  # before the checkpoint wrappers
    fsdp_config = cfg.fsdp_config or (FSDPConfig(sharding_strategy="NO_SHARD") if world_size > 1 else None)
    checkpointed = _checkpointed_blocks(model, fsdp_config)
    precision = "amp_bf16" if str(cfg.precision) == "auto" else str(cfg.precision)  # auto, on a GPU
    with fake_process_group(world_size, ranks_per_node):
        parallelism, dims = job_layout(fsdp_config, cfg.parallelism)
        if world_size > 1:
            place_model(model, torch.device("meta"), fsdp_config, precision, parallelism, dims)
        microbatch = cfg.device_train_microbatch_size
        microbatch = device_batch if microbatch in (None, "auto") else min(microbatch, device_batch)
        step = _Step(
            microbatches=math.ceil(device_batch / microbatch),
            tokens=microbatch * (cfg.max_seq_len or model.config.max_seq_len) // dims.cp,
            kept_gathered=_kept_gathered(model, fsdp_config, device_memory_gib),
        )
        activations = _activation_plan(model, fsdp_config, precision, step, checkpointed, dims.cp)
        memory = _memory(model, cfg, fsdp_config, precision, step, activations)
        collectives = _collectives(model, fsdp_config, precision, step, checkpointed, dims)
        shape = BlockShape.of(model.config)
        by_checkpointed = tuple(
            activation_bytes(shape, dataclasses.replace(activations, checkpointed_blocks=k))
            for k in range(len(blocks_of(model)) + 1)
        )
    return DryRunPlan(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        mesh={"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "ep": dims.ep},
        parameters=sum(parameter.numel() for parameter in model.parameters()),
        fsdp_units=sum(isinstance(module, FSDPModule) for module in model.modules()),
        checkpointed_blocks=checkpointed,
        blocks=len(blocks_of(model)),
        microbatches_per_step=step.microbatches,
        tokens_per_microbatch=step.tokens,
        kept_gathered=step.kept_gathered and world_size > 1,
        memory_bytes=memory,
        collectives=collectives,
        activation_bytes_by_checkpointed=by_checkpointed,
        block_class=block_class,
    )


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


@contextlib.contextmanager
def fake_process_group(world_size: int, ranks_per_node: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks whose collectives do nothing (``LOCAL_WORLD_SIZE`` set)."""
    if dist.is_initialized():
        raise RuntimeError("A dry run needs a process without a process group; this one has one.")
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


@dataclasses.dataclass(frozen=True)
class _Step:
    microbatches: int
    tokens: int  # a GPU's, in one microbatch
    kept_gathered: bool


def _meta_model(section: dict[str, Any]) -> nn.Module:
    """The model on the meta device; only foundry's families, whose shapes the activation count reads."""
    name = section.get("name")
    if name not in PLANNED_MODELS:
        raise ConfigError(
            f"'model.name' is {name!r}; the dry run plans {' and '.join(PLANNED_MODELS)} models, whose block shapes "
            "it reads. For a Hugging Face model, write its widths as a llama_causal_lm section (docs/MODELS.md)."
        )
    return build_model({**section, "init_device": "meta"})


def _check_world(world_size: int, ranks_per_node: int) -> None:
    if world_size < 1:
        raise ConfigError(f"--world-size is {world_size}; give the number of GPUs of the job, e.g. --world-size 256.")
    if world_size % ranks_per_node:
        raise ConfigError(
            f"--world-size {world_size} is not a whole number of nodes of --nproc {ranks_per_node} GPUs (torchrun "
            f"starts as many on every node). Give a multiple of {ranks_per_node}, e.g. "
            f"{world_size - world_size % ranks_per_node or ranks_per_node}, or the GPUs a node has with --nproc."
        )


def _checkpointed_blocks(model: nn.Module, fsdp_config: FSDPConfig | None) -> int:
    """Blocks checkpointed whole (a block of which only some modules are checkpointed counts as not)."""
    if fsdp_config is None or not fsdp_config.activation_checkpointing:
        return 0
    if fsdp_config.activation_checkpointing == "auto":  # else planned as every block, with no word on one rank
        raise ConfigError(
            "fsdp_config.activation_checkpointing is 'auto', a choice the dry run does not plan itself: "
            "foundry.config.auto_checkpointing.choose_checkpointing makes it first (as `foundry train --dry-run` does)."
        )
    blocks = blocks_of(model)
    plan = checkpoint_plan(blocks, getattr(model.config, "activation_checkpointing_target", None))
    return sum(modules == [block] for block, modules in zip(blocks, plan))


def _kept_gathered(model: nn.Module, fsdp_config: FSDPConfig | None, device_memory_gib: float) -> bool:
    """``GradientAccumulation``'s choice for the card: a model small for it stays gathered between microbatches."""
    small = model_is_small_for(model, None, int(device_memory_gib * GIB))
    reshard = fsdp_config.reshard_between_microbatches if fsdp_config else None
    return small if reshard is None else not reshard


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_expert(parameter: torch.Tensor) -> bool:
    """Expert parameters live on the ``ep`` axis, beside FSDP2's shards (``shard_experts``)."""
    return isinstance(parameter, DTensor) and parameter.device_mesh.mesh_dim_names == ("ep",)


def _activation_plan(
    model: nn.Module, fsdp_config: FSDPConfig | None, precision: str, step: _Step, checkpointed: int, cp: int
) -> ActivationPlan:
    """How one microbatch's activations are held on a GPU (``foundry.models.activations`` counts them)."""
    low = compute_dtype(precision)
    policy = mixed_precision_policy(fsdp_config.mixed_precision if fsdp_config else "FULL", precision)  # no FSDP: fp32
    return ActivationPlan(
        tokens=step.tokens,
        checkpointed_blocks=checkpointed,
        keep_attention=bool(fsdp_config and fsdp_config.activation_checkpointing_keep_attention),
        element_bytes=low.itemsize if low is not None else 4,
        residual_bytes=(policy.param_dtype or torch.float32).itemsize,
        fused_loss=model.config.loss_fn != "torch_crossentropy",  # auto fuses on a GPU
        gathered_sequence=cp,
    )


def _memory(
    model: nn.Module, cfg: TrainConfig, fsdp_config: FSDPConfig | None, precision: str, step: _Step,
    activations: ActivationPlan,
) -> dict[str, int]:  # fmt: skip
    """Per GPU, at the peak of a step: rank 0's shards (the largest: FSDP2 gives rank 0 the rounded-up share)."""
    shards = sum(stored_bytes(p) for p in model.parameters())
    trainable = [_local(p) for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    trainable_elements = sum(p.numel() for p in trainable)
    moments_bytes = 2 if cfg.optimizer.get("moments_dtype") == "bfloat16" else 4
    states = OPTIMIZER_STATES.get(cfg.optimizer.get("name", ""), 2)
    element_bytes, residual_bytes = activations.element_bytes, activations.residual_bytes
    low = compute_dtype(precision)
    units, gradients = _fsdp_units(model), sum(p.numel() * p.element_size() for p in trainable)
    if not units:  # one GPU: each linear's weight cast once a step is kept for the step (fuse_weight_grad_accumulation)
        local_elements = sum(_local(p).numel() for p in model.parameters())
        gathered = local_elements * element_bytes if low is not None else 0
    elif step.kept_gathered:  # every unit gathered, and its unsharded gradient sum
        gathered = sum(unit.gathered_bytes(residual_bytes) for unit in units.values())
        # The sums are reduce-scattered unit by unit, at the step's end, into the shards that replace them.
        gradients = max(gradients, sum(unit.trainable for unit in units.values()) * residual_bytes)
    else:  # the root and two blocks (one running, one prefetched), each with its unsharded gradient
        root = units.pop(model, _Unit())
        block = max(units.values(), key=lambda unit: unit.gathered_bytes(residual_bytes), default=_Unit())
        gathered = sum(
            unit.gathered_bytes(residual_bytes) + unit.trainable * residual_bytes for unit in (root, block, block)
        )
    return {
        "parameters (shards)": shards,
        "gradients": gradients,
        f"optimizer ({states} state{'s' * (states != 1)})": states * trainable_elements * moments_bytes,
        "gathered working set": gathered,
        "activations": activation_bytes(BlockShape.of(model.config), activations),
    }


@dataclasses.dataclass
class _Unit:
    """What one FSDP2 unit gathers: its parameters outside nested units, experts aside."""

    elements: int = 0  # gathered in FSDP2's param_dtype (those of NF4 weights aside)
    nf4_bytes: int = 0  # NF4 weights gather their codes and scales as they are stored
    trainable: int = 0  # elements with gradients (LoRA: the adapters), reduced after backward

    def gathered_bytes(self, element_bytes: int) -> int:
        return self.elements * element_bytes + self.nf4_bytes


def _fsdp_units(model: nn.Module) -> dict[nn.Module, _Unit]:
    """Each FSDP2 unit and what it gathers."""
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    owner: dict[nn.Parameter, nn.Module] = {}
    for module in modules:  # outer units first: an inner unit takes its parameters over
        owner.update(dict.fromkeys(module.parameters(), module))
    units = {module: _Unit() for module in modules}
    for parameter, module in owner.items():
        if _is_expert(parameter):
            continue
        unit = units[module]
        if is_nf4(parameter):
            unit.nf4_bytes += stored_bytes(parameter) * parameter.numel() // _local(parameter).numel()  # all shards
        else:
            unit.elements += parameter.numel()
        unit.trainable += parameter.numel() if parameter.requires_grad else 0
    return units


def _collectives(
    model: nn.Module, fsdp_config: FSDPConfig | None, precision: str, step: _Step, checkpointed: int, dims: Any
) -> list[Collective]:
    """What one step sends: FSDP2's gathers and reductions, context parallelism's k/v gathers, EP's all-to-alls."""
    units = _fsdp_units(model)
    if not units:
        return []
    policy = mixed_precision_policy(fsdp_config.mixed_precision, precision)
    gather_bytes = (policy.param_dtype or torch.float32).itemsize
    reduce_bytes = (policy.reduce_dtype or policy.param_dtype or torch.float32).itemsize
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor) and not _is_expert(p)).device_mesh
    replicas, shard = (mesh.size(0), mesh.size(1)) if mesh.ndim == 2 else (1, mesh.size())
    shard_axis = f"{mesh.mesh_dim_names[-1]} ({shard})"
    total = sum(unit.gathered_bytes(gather_bytes) for unit in units.values())
    trainable = sum(unit.trainable for unit in units.values())
    blocks, micro = len(units) - 1, step.microbatches
    reshard_after_forward = STRATEGIES[fsdp_config.sharding_strategy][1]
    rows: list[Collective] = []
    if shard > 1:
        if step.kept_gathered:  # each unit gathered once a step, reduced once
            gathers, gathered, reductions = len(units), total, len(units)
        else:  # every microbatch; backward gathers again each block resharded after forward (all but the last)
            again = (blocks - 1) if reshard_after_forward else 0
            block_bytes = [unit.gathered_bytes(gather_bytes) for module, unit in units.items() if module is not model]
            gathers, gathered = (len(units) + again) * micro, (total + again * max(block_bytes, default=0)) * micro
            every = fsdp_config.reduce_every_microbatch
            reductions = len(units) * micro if (not step.kept_gathered if every is None else every) else len(units)
        reduced = trainable * reductions // len(units)
        rows.append(Collective("all-gather", "parameters", shard_axis, gathers, gathered))
        rows.append(Collective("reduce-scatter", "gradients", shard_axis, reductions, reduced * reduce_bytes))
    if replicas > 1:
        calls = len(units) * (micro if not step.kept_gathered else 1)
        buffer = trainable // shard * reduce_bytes * calls // len(units)
        rows.append(
            Collective("all-reduce", "gradient shards", f"{mesh.mesh_dim_names[0]} ({replicas})", calls, buffer)
        )
    rows += _sequence_and_expert_collectives(model, step, checkpointed, dims, gather_bytes)
    return rows


def _sequence_and_expert_collectives(
    model: nn.Module, step: _Step, checkpointed: int, dims: Any, element_bytes: int
) -> list[Collective]:
    """Context parallelism gathers each attention layer's k and v (again when a checkpointed block recomputes) and
    reduce-scatters their gradients; expert parallelism sends each MoE layer's routed rows and returns them."""
    shape = BlockShape.of(model.config)
    layers, micro, rows = shape.n_layers, step.microbatches, []
    if dims.cp > 1:
        calls = 2 * (layers + checkpointed) * micro
        whole = step.tokens * dims.cp * shape.kv_dim * element_bytes
        rows.append(Collective("all-gather", "k and v", f"cp ({dims.cp})", calls, calls * whole))
        reductions = 2 * layers * micro
        rows.append(
            Collective("reduce-scatter", "k and v gradients", f"cp ({dims.cp})", reductions, reductions * whole)
        )
    if dims.ep > 1 and shape.top_k:
        routed = step.tokens * shape.top_k * shape.d_model * element_bytes
        passes = 2 + (checkpointed > 0)  # forward, backward, recompute
        calls = 2 * layers * micro * passes
        rows.append(
            Collective("all-to-all", "routed rows (dispatch, combine)", f"ep ({dims.ep})", calls, calls * routed)
        )
    return rows
