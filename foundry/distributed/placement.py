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
7. weights: when every rank built the model on the meta device, each rank allocates its shards and either
   reads the model's pretrained files a layer at a time, keeping its slices (``StreamedWeights``:
   ``hf_causal_lm`` from a local folder), or, for a model that initialises a module at a time
   (``ModuleByModuleInit``: MPT and Llama, LoRA and QLoRA included, without expert or tensor parallelism), rank 0
   initialises one module's parameters at a time in host memory with the run's seed and each rank keeps its slice
   of them (an NF4 shard quantizes its slice): no host ever holds more than its shards plus one layer or module.
   Otherwise, when some rank built it on the meta device (or ``sync_module_states`` is set), rank 0 materialises
   and initialises the full model in host memory, and its weights reach the other ranks one parameter at a time,
   each rank keeping its shard. Device memory never holds more than a shard plus one parameter. Without the meta
   device every rank already holds the same seeded weights.

What each step acts on comes from the model (``foundry.distributed.protocol``); docs/DISTRIBUTED.md tabulates
how each ``fsdp_config`` key maps to FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from foundry.core.parallel_dims import ParallelDims
from foundry.core.precision import cast_embeddings_to_autocast_dtype, compute_dtype
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing, apply_activation_offload
from foundry.distributed.config import FSDPConfig, ParallelismConfig, with_fsdp_aliases
from foundry.distributed.context_parallel import ContextParallel, WholeSequences, apply_context_parallel
from foundry.distributed.env import all_reduce_sum, get_rank, get_world_size
from foundry.distributed.expert_parallel import shard_experts
from foundry.distributed.fsdp import STRATEGIES, GradientAccumulation, mixed_precision_policy
from foundry.distributed.host_memory import check_fits_by_module, check_fits_in_host_memory
from foundry.distributed.mesh import JobMesh, build_mesh, parallel_dims
from foundry.distributed.process_group import init_process_group
from foundry.distributed.protocol import InitStep, blocks_of, finish_sharding, init_steps_of, weight_layers_of
from foundry.distributed.tensor_parallel import (
    apply_tensor_parallel,
    check_fsdp_shards_compose,
    fill_parts,
    fsdp_shard_placement,
    has_parts,
)
from foundry.errors import ConfigError
from foundry.schema import parse_dataclass

log = logging.getLogger(__name__)
Fill = Callable[[nn.Module, torch.device], None]  # fills a sharded model's weights on every rank (_shared_weights)
_WRAPPER_PREFIXES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")  # checkpointing, compile


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
    # Before tensor parallelism, which gives each rank its share of the heads: the weights are the whole model's.
    by_module = dims.ep == 1 and dims.tp == 1  # expert and tensor parallelism: rank 0's whole copy
    draws = {"sync_module_states": config.sync_module_states, "init_on_device": config.init_on_device}
    weights = None if dry_run else _shared_weights(model, device, by_module, **draws)
    if dims.tp > 1:
        if isinstance(weights, Mapping):  # rank 0's weights arrive after placement: split meta tensors alike
            _parameters_to_meta(model)
        apply_tensor_parallel(model, mesh["tp"], parallelism.sequence_parallel)
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
    finish_sharding(model)  # e.g. QLoRA's NF4 shards, made ready to be filled
    if config.forward_prefetch:
        for block, next_block in itertools.pairwise(blocks):
            block.set_modules_to_forward_prefetch([next_block])
    _materialise(model, torch.device("cpu") if offload else device, device, weights)
    if config.verbose and get_rank() == 0:
        log.info("FSDP2 (%s) on mesh %s: %d blocks, then the root.", config.sharding_strategy, mesh, len(blocks))
    return Placement(GradientAccumulation(model, blocks, config, device), batches, mesh)  # type: ignore[arg-type]


def shards(config: FSDPConfig, device: torch.device) -> bool:
    """Whether ``fully_shard`` is applied: with several ranks, or to offload parameters to the CPU."""
    return get_world_size() > 1 or (config.cpu_offload and device.type == "cuda")


def _wrap_blocks(model: nn.Module, config: FSDPConfig, device: torch.device) -> list[nn.Module]:
    """Activation checkpointing and activation offload around the blocks; returns the (wrapped) blocks."""
    blocks = blocks_of(model)
    if config.activation_checkpointing == "auto":
        raise ConfigError(
            "fsdp_config.activation_checkpointing is 'auto', which `foundry train` resolves from the YAML by the dry "
            "run's plan before it builds the Trainer. A Trainer built in Python takes true or false: get auto's "
            "choice from foundry.config.auto_checkpointing.choose_checkpointing(cfg, world_size, ranks_per_node, "
            "gpu_memory_gib) before the process group starts (it plans on a fake one), or set it yourself."
        )
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
        init_on_cpu(model, device)  # as rank 0 does for a sharded run: the same initial weights at any world size
    model.to(device)
    _wrap_blocks(model, config, device)
    if compute_dtype(precision) is not None and config.mixed_precision in ("PURE", "DEFAULT"):
        cast_embeddings_to_autocast_dtype(model)


def _shared_weights(
    model: nn.Module, device: torch.device, may_init_by_module: bool, sync_module_states: bool, init_on_device: bool
) -> Mapping[str, Any] | Fill | None:
    """Where the sharded weights come from when other ranks must receive them, else None.

    They must when any rank built the model on the meta device (``init_device: meta`` or ``mixed``)
    or ``sync_module_states`` asks. When every rank did and the model streams its files or initialises a module
    at a time, what fills the shards after sharding, on every rank. Otherwise rank 0's full weights (an empty dict
    elsewhere): rank 0 initialises on the CPU with the run's seed, so the sharded model starts from exactly
    the weights an unsharded ``init_device: cpu`` run gets.
    """
    on_meta = any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    ranks_on_meta = int(all_reduce_sum(torch.tensor(float(on_meta), device=device)).item())
    if not (ranks_on_meta or sync_module_states):
        return None
    if ranks_on_meta == get_world_size() and may_init_by_module:
        layers = weight_layers_of(model)
        if layers is not None:
            return functools.partial(_load_by_layer, layers=layers)
        steps = init_steps_of(model)
        if steps is not None:
            return functools.partial(_init_by_module, steps=steps, on_device=init_on_device)
    if get_rank() != 0:
        return {}
    if on_meta:
        init_on_cpu(model, device)
    return model.state_dict()


def init_on_cpu(model: nn.Module, device: torch.device | None = None) -> None:
    """Materialise a meta-device model on the CPU and initialise it, leaving the random generators as they were.

    Every placement of a meta-device model goes through here, so the same seed gives the same initial
    weights on any device and at any world size (CPU and CUDA generators draw different numbers).
    ``device``: the run's, which the refusal of a model too large for the host names (default: the CPU).
    """
    if not hasattr(model, "init_weights"):
        raise ConfigError(
            f"{type(model).__name__} was built on the meta device but has no init_weights(), so its weights "
            "cannot be created. Build it on the CPU (model.init_device: cpu)."
        )
    check_fits_in_host_memory(model, device or torch.device("cpu"))
    with torch.random.fork_rng(devices=[]):  # every rank's generators stay in step for training
        model.to_empty(device="cpu")
        model.init_weights()


def _parameters_to_meta(model: nn.Module) -> None:
    """Every parameter a meta tensor again (rank 0 drew them: its whole weights are kept to send), the buffers
    as they are."""
    buffers = dict(model.named_buffers())
    model.to_empty(device="meta")
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer


def _materialise(
    model: nn.Module,
    param_device: torch.device,
    buffer_device: torch.device,
    weights: Mapping[str, Any] | Fill | None,
) -> None:
    """Allocate meta shards (and buffers) and fill them from ``weights`` (``_shared_weights``), if any."""
    if any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
        kept = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}  # rank 0 sends them
        model.to_empty(device=param_device)
        if buffer_device != param_device:  # with cpu_offload the shards live on the CPU, buffers on the device
            for module in model.modules():
                for name, buffer in module._buffers.items():
                    module._buffers[name] = None if buffer is None else buffer.to(buffer_device)
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])
    if weights is None:
        return
    if callable(weights):
        weights(model, buffer_device)  # whole parameters travel on the compute device, also with cpu_offload
        return
    weights = fill_parts(model, weights, buffer_device)  # tensor parallelism's fused projections
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not has_parts(model))
    set_model_state_dict(model, weights, options=options)
    for buffer in model.buffers():  # non-persistent buffers (e.g. rotary tables) are not in a state dict
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def _init_by_module(model: nn.Module, device: torch.device, steps: list[InitStep], on_device: bool = False) -> None:
    """Fill the sharded ``model`` as ``init_on_cpu`` would the whole one, holding one module at a time.

    Rank 0 runs each step on its module's parameters made whole on the CPU, in the model's order with the run's
    generator (so the values are those of an unsharded init); each rank keeps its slice of them. A 4-bit (NF4)
    shard quantizes its slice of the whole values as it is copied in. ``on_device`` (``fsdp_config.init_on_device``)
    makes them whole on ``device`` and draws with its generator: the CPU's draws one number after another (about
    0.2 billion a second: at that rate 70B takes minutes and 405B half an hour), a GPU's at memory speed.
    """
    draw_on = device if on_device else torch.device("cpu")
    if get_rank() == 0 and draw_on.type == "cpu":
        check_fits_by_module(model, [module for module, _ in steps], device)
    forked = {"devices": []} if draw_on.type == "cpu" else {"devices": [draw_on], "device_type": draw_on.type}
    with torch.random.fork_rng(**forked):  # every rank's generators stay in step for training
        for module, initialise in steps:
            sharded = {name: param for name, param in module._parameters.items() if param is not None}
            if not sharded:
                continue
            whole = {
                name: torch.empty(param.shape, dtype=param.dtype, device=draw_on) for name, param in sharded.items()
            }
            if get_rank() == 0:
                module._parameters.update({name: nn.Parameter(tensor) for name, tensor in whole.items()})
                try:
                    initialise(module)
                finally:
                    module._parameters.update(sharded)
            for name, param in sharded.items():
                _keep_own_slice(param, whole[name].to(device))
            del whole  # before the next module's


@torch.no_grad()
def _load_by_layer(model: nn.Module, device: torch.device, layers: Iterator[dict[str, torch.Tensor]]) -> None:
    """Fill the sharded ``model`` from files every rank reads a layer at a time, each keeping its slices."""
    tensors = {
        _WRAPPER_PREFIXES.sub("", name): tensor
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    }
    filled, unknown = set(), []
    for layer in layers:
        for name, whole in layer.items():
            if name not in tensors:
                unknown.append(name)
                continue
            _keep_own_slice(tensors[name], whole.to(device), src_data_rank=None)
            filled.add(id(tensors[name]))
    missing = [_WRAPPER_PREFIXES.sub("", name) for name, param in model.named_parameters() if id(param) not in filled]
    if missing or unknown:
        raise ConfigError(
            f"The pretrained weights do not fit this model: none for {missing[:3]}, no parameter for {unknown[:3]}. "
            "Check that the model section names the folder these weights belong to (pretrained_model_name_or_path)."
        )


def _keep_own_slice(param: torch.Tensor, whole: torch.Tensor, src_data_rank: int | None = 0) -> None:
    """``whole``, the value of ``param`` on rank ``src_data_rank`` (None: on every rank), into this rank's shard of
    it (all of it when unsharded)."""
    if not isinstance(param, DTensor):
        if src_data_rank is not None:
            dist.broadcast(whole, src=src_data_rank)
        param.copy_(whole)
        return
    own = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=src_data_rank)
    param.to_local().copy_(own.to_local())


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
