"""Placing a model on the job's ranks: every parallelism applied in one place, in one order.

``parallelize(model, fsdp_config, device, precision, parallelism)`` changes ``model`` in place (torchtitan's
``parallelize`` step). On one rank (without ``cpu_offload``) sharding buys nothing and costs copies in and
out of FSDP's buffers (two points of MFU for compiled MPT-125M on an H100), so FSDP is skipped there: the
model gets its activation checkpointing and the activation precision ``mixed_precision`` gives (a bf16
residual stream for PURE and DEFAULT, as FSDP's bf16 parameters would), and the same initial weights.
With several ranks, in this order:

1. the job's mesh (``foundry.distributed.mesh``), built once from ``job_dims`` and returned for the run
   to keep (``State.mesh``): ``sharding_strategy`` lays out the data-parallel ranks,
   ``parallelism.context_parallel_degree`` the ranks that split sequences, ``tensor_parallel_degree`` the
   ranks that split layers;
2. tensor parallelism: the linears the model's plan names split by column or row over ``tp``
   (``foundry.distributed.tensor_parallel``);
3. context parallelism: each attention layer the model declares gathers keys and values over ``cp``;
4. expert parallelism: each expert layer the model declares keeps its share of the experts;
5. activation checkpointing (and activation CPU offload) around the blocks the model declares; blocks
   already compiled (``compile_config``, at ``Event.INIT``) keep their compiled forward inside the wrapper;
6. ``fully_shard`` on each block, then on the root (embeddings, final norm, output head), over the
   mesh's ``dp_shard_cp`` axis (with ``dp_replicate`` outside it for HYBRID_SHARD and NO_SHARD);
7. weights: when some rank built the model on the meta device (or ``sync_module_states`` is set),
   rank 0 materialises and initialises the full model in host memory, and its weights reach the
   other ranks one parameter at a time, each rank keeping its shard; device memory never holds more
   than a shard plus one parameter. Otherwise every rank already holds the same seeded weights.

What each step acts on comes from the model (``foundry.distributed.protocol``); docs/DISTRIBUTED.md tabulates
how each ``fsdp_config`` key maps to FSDP2.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from foundry.core.parallel_dims import ParallelDims
from foundry.core.precision import cast_embeddings_to_autocast_dtype, compute_dtype
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing, apply_activation_offload
from foundry.distributed.config import FSDPConfig, ParallelismConfig, with_fsdp_aliases
from foundry.distributed.context_parallel import ContextParallel, WholeSequences, apply_context_parallel
from foundry.distributed.env import all_reduce_sum, get_rank, get_world_size
from foundry.distributed.expert_parallel import shard_experts
from foundry.distributed.fsdp import STRATEGIES, GradientAccumulation, mixed_precision_policy
from foundry.distributed.mesh import JobMesh, build_mesh, parallel_dims
from foundry.distributed.process_group import init_process_group
from foundry.distributed.protocol import blocks_of
from foundry.distributed.tensor_parallel import (
    apply_tensor_parallel,
    check_fsdp_shards_compose,
    fsdp_shard_placement,
)
from foundry.errors import ConfigError
from foundry.schema import parse_dataclass

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Placement:
    """What the loop needs from a placed model: when to reduce gradients, how to split each batch, the mesh."""

    accumulation: GradientAccumulation | None = None  # None: unsharded
    batches: ContextParallel | WholeSequences = dataclasses.field(default_factory=WholeSequences)
    mesh: JobMesh | None = None  # None: one rank, nothing sharded


def job_dims(fsdp_config: FSDPConfig | None, parallelism: ParallelismConfig | None = None) -> ParallelDims:
    """The degree of each mesh axis for this job: ``fsdp_config``'s rank layout and ``parallelism``'s degrees
    (its aliases already applied).

    Without ``fsdp_config`` every rank holds the whole model (several ranks get NO_SHARD: ``prepare_sharding``).
    """
    layout = "shard" if fsdp_config is None else STRATEGIES[fsdp_config.sharding_strategy][0]
    return parallel_dims(layout, parallelism or ParallelismConfig())


def job_layout(
    fsdp_config: FSDPConfig | None, parallelism: ParallelismConfig
) -> tuple[ParallelismConfig, ParallelDims]:
    """``parallelism`` with ``fsdp_config``'s deprecated spelling of a degree applied (it warns here, once a run),
    and the job's degrees (``job_dims``)."""
    if fsdp_config is not None:
        parallelism = with_fsdp_aliases(parallelism, fsdp_config)
    return parallelism, job_dims(fsdp_config, parallelism)


def parallelize(
    model: nn.Module,
    config: FSDPConfig,
    device: torch.device,
    precision: str,
    parallelism: ParallelismConfig | None = None,
    dims: ParallelDims | None = None,
) -> Placement:
    """Shard ``model`` over every rank as ``config`` (an ``FSDPConfig``) says; the process group must exist.

    Args:
        model: built on the CPU (every rank, same seed), on the meta device, or ``mixed``.
        config: ``fsdp_config``; ``model.config.activation_checkpointing_target`` picks what to checkpoint.
        device: this rank's device; the shards live there (on the CPU with ``cpu_offload``).
        precision: the run's precision; ``mixed_precision`` applies only to the amp precisions.
        parallelism: the mesh's degrees beyond data parallelism (``context_parallel_degree``,
            ``expert_parallel_degree``, ``tensor_parallel_degree``).
        dims: the job's degrees when the caller resolved them with ``parallelism`` (``job_layout``).

    Returns:
        How the model moves gradients and parameters between microbatches, how batches are split, and the mesh.
    """
    reshard_after_forward = STRATEGIES[config.sharding_strategy][1]
    if dims is None:  # called on its own, not by the Trainer (which resolved both once for the run)
        parallelism, dims = job_layout(config, parallelism or ParallelismConfig())
    parallelism = parallelism or ParallelismConfig()
    if not shards(config, device):  # one rank: parallel_dims refused any degree above 1
        _place_unsharded(model, config, device, precision)
        return Placement()
    # The meta device: a dry run (foundry/config/dry_run.py) on torch's fake process group, never given weights.
    dry_run = device.type == "meta"
    mesh = build_mesh(dims, "cpu" if dry_run else device.type)
    rank0_weights = None if dry_run else _rank0_weights(model, config.sync_module_states, device)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
        check_fsdp_shards_compose(model, mesh.dp_shard_cp.size())
    cp_attention = parallelism.context_parallel_attention
    batches = apply_context_parallel(model, mesh["cp"], cp_attention) if dims.cp > 1 else WholeSequences()
    expert_params = shard_experts(model, mesh.ep)  # FSDP leaves them be
    blocks = _wrap_blocks(model, config, device)
    offload = config.cpu_offload and device.type == "cuda"
    shard_settings = {
        "mesh": mesh.fsdp,
        "mp_policy": mixed_precision_policy(config.mixed_precision, precision),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        "ignored_params": expert_params or None,
        "shard_placement_fn": fsdp_shard_placement if dims.tp > 1 else None,
    }
    for index, block in enumerate(blocks):
        # The last block would be gathered again at once for backward: keeping it whole saves an all-gather.
        is_last = index == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not is_last, **shard_settings)
    # The root (embeddings, final norm, output head) runs last in forward and first in backward: resharding it
    # in between would put an all-gather of the largest parameters on the critical path, every microbatch.
    fully_shard(model, reshard_after_forward=False, **shard_settings)
    if config.forward_prefetch:
        for block, next_block in itertools.pairwise(blocks):
            block.set_modules_to_forward_prefetch([next_block])
    _materialise(model, torch.device("cpu") if offload else device, device, rank0_weights)
    if config.verbose and get_rank() == 0:
        log.info("FSDP2 (%s) on mesh %s: %d blocks, then the root.", config.sharding_strategy, mesh, len(blocks))
    return Placement(GradientAccumulation(model, blocks, config, device), batches, mesh)  # type: ignore[arg-type]


def shards(config: FSDPConfig, device: torch.device) -> bool:
    """Whether ``fully_shard`` is applied: with several ranks, or to offload parameters to the CPU."""
    return get_world_size() > 1 or (config.cpu_offload and device.type == "cuda")


def _wrap_blocks(model: nn.Module, config: FSDPConfig, device: torch.device) -> list[nn.Module]:
    """Activation checkpointing and activation offload around the blocks; returns the (wrapped) blocks."""
    blocks = blocks_of(model)
    if config.activation_checkpointing:
        target = getattr(getattr(model, "config", None), "activation_checkpointing_target", None)
        blocks = apply_activation_checkpointing(
            model, blocks, target, config.activation_checkpointing_reentrant,
            keep_attention=config.activation_checkpointing_keep_attention,
        )  # fmt: skip
    if config.activation_cpu_offload and device.type == "cuda":  # on a CPU run activations are in host memory
        blocks = apply_activation_offload(model, blocks)
    return blocks


def _place_unsharded(model: nn.Module, config: FSDPConfig, device: torch.device, precision: str) -> None:
    """One rank: the weights a sharded run starts from, on ``device``, with the block wrappers and precision."""
    if any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
        init_on_cpu(model)  # as rank 0 does for a sharded run: the same initial weights at any world size
    model.to(device)
    _wrap_blocks(model, config, device)
    if compute_dtype(precision) is not None and config.mixed_precision in ("PURE", "DEFAULT"):
        cast_embeddings_to_autocast_dtype(model)


def _rank0_weights(model: nn.Module, sync_module_states: bool, device: torch.device) -> Mapping[str, Any] | None:
    """Rank 0's full weights (an empty dict elsewhere) when other ranks must receive them, else None.

    They must when any rank built the model on the meta device (``init_device: meta`` or ``mixed``)
    or ``sync_module_states`` asks. Rank 0 then initialises on the CPU with the run's seed, so the
    sharded model starts from exactly the weights an unsharded ``init_device: cpu`` run gets.
    """
    on_meta = any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    ranks_on_meta = all_reduce_sum(torch.tensor(float(on_meta), device=device))
    if not (ranks_on_meta.item() or sync_module_states):
        return None
    if get_rank() != 0:
        return {}
    if on_meta:
        init_on_cpu(model)
    return model.state_dict()


def init_on_cpu(model: nn.Module) -> None:
    """Materialise a meta-device model on the CPU and initialise it, leaving the random generators as they were.

    Every placement of a meta-device model goes through here, so the same seed gives the same initial
    weights on any device and at any world size (CPU and CUDA generators draw different numbers).
    """
    if not hasattr(model, "init_weights"):
        raise ConfigError(
            f"{type(model).__name__} was built on the meta device but has no init_weights(), so its weights "
            "cannot be created. Build it on the CPU (model.init_device: cpu)."
        )
    with torch.random.fork_rng(devices=[]):  # every rank's generators stay in step for training
        model.to_empty(device="cpu")
        model.init_weights()


def _materialise(
    model: nn.Module, param_device: torch.device, buffer_device: torch.device, rank0_weights: Mapping[str, Any] | None
) -> None:
    """Allocate meta shards (and buffers) and fill them from rank 0's weights, if any."""
    if any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=param_device)
        if buffer_device != param_device:  # with cpu_offload the shards live on the CPU, buffers on the device
            for module in model.modules():
                for name, buffer in module._buffers.items():
                    module._buffers[name] = None if buffer is None else buffer.to(buffer_device)
    if rank0_weights is None:
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(rank0_weights), options=options)
    for buffer in model.buffers():  # non-persistent buffers (e.g. rotary tables) are not in a state dict
        dist.broadcast(buffer, src=0)


def prepare_sharding(config: FSDPConfig | Mapping[str, Any] | None, optimizers: Any) -> FSDPConfig | None:
    """The ``FSDPConfig`` a Trainer applies (None: a plain module), with the process group ready.

    Several ranks without one get ``NO_SHARD``: their gradients must still be averaged. A sharded
    model gets new parameters, so ``optimizers`` must be a factory called after sharding.
    """
    if isinstance(config, Mapping):
        config = parse_dataclass(FSDPConfig, config, "fsdp_config")
    if config is None and get_world_size() > 1:
        config = FSDPConfig(sharding_strategy="NO_SHARD")
    if config is None:
        return None
    if optimizers is not None and not callable(optimizers):
        raise ConfigError(
            "The model is sharded (fsdp_config, or several ranks), which replaces its parameters, so an optimizer "
            "built beforehand would update stale ones. Pass a function instead, e.g. "
            "optimizers=lambda params: DecoupledAdamW(params, lr=6e-4)."
        )
    init_process_group()  # a no-op when the launcher's group exists
    return config


def place_model(
    model: nn.Module,
    device: torch.device,
    fsdp_config: FSDPConfig | None,
    precision: str,
    parallelism: ParallelismConfig | None = None,
    dims: ParallelDims | None = None,
) -> Placement:
    """Shard ``model`` onto ``device`` with FSDP2 over the mesh ``parallelism`` shapes, or move it there."""
    if fsdp_config is not None:
        return parallelize(model, fsdp_config, device, precision, parallelism, dims)
    parallelism = parallelism or ParallelismConfig()
    dims or job_dims(None, parallelism)  # a degree above 1 needs as many ranks
    if parallelism.expert_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_degree is {parallelism.expert_parallel_degree} but the run has no "
            "fsdp_config: expert parallelism places the experts beside FSDP2's shards. Add 'fsdp_config: "
            "{sharding_strategy: FULL_SHARD}' or set the degree to 1."
        )
    if any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
        init_on_cpu(model)  # the weights a sharded run of the same seed starts from
    model.to(device)
    return Placement()
