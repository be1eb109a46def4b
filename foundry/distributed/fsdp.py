"""FSDP2 and activation checkpointing, applied in one place (torchtitan's ``parallelize`` step).

``parallelize(model, fsdp_config, device, precision, parallelism)`` changes ``model`` in place. On one rank
(without ``cpu_offload``) sharding buys nothing and costs copies in and out of FSDP's buffers (two
points of MFU for compiled MPT-125M on an H100), so FSDP is skipped there: the model gets its
activation checkpointing and the activation precision ``mixed_precision`` gives (a bf16 residual
stream for PURE and DEFAULT, as FSDP's bf16 parameters would), and the same initial weights.
With several ranks:

1. the job's DeviceMesh (``foundry.distributed.mesh``): ``sharding_strategy`` lays out the data-parallel
   ranks, ``parallelism.context_parallel_degree`` the ranks that split sequences; with context
   parallelism the attention layers gather keys and values over ``cp`` (``context_parallel.py``);
2. activation checkpointing (and activation CPU offload) around the chosen blocks;
3. ``fully_shard`` on each block, then on the root (embeddings, final norm, output head), over the
   mesh's ``dp_shard_cp`` axis (with ``dp_replicate`` outside it for HYBRID_SHARD and NO_SHARD);
4. weights: when some rank built the model on the meta device (or ``sync_module_states`` is set),
   rank 0 materialises and initialises the full model in host memory, and its weights reach the
   other ranks one parameter at a time, each rank keeping its shard; device memory never holds more
   than a shard plus one parameter. Otherwise every rank already holds the same seeded weights.

Blocks are ``model.fsdp_wrap_modules()`` when the model defines it, else ``model.transformer.blocks``
(MPT, Llama), else the classes a Hugging Face model lists in ``_no_split_modules``. docs/DISTRIBUTED.md
tabulates how each ``fsdp_config`` key maps to FSDP2.
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from foundry.core.precision import cast_embeddings_to_autocast_dtype, compute_dtype
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing, apply_activation_offload
from foundry.distributed.config import FSDPConfig, ParallelismConfig, with_fsdp_aliases
from foundry.distributed.context_parallel import ContextParallel, WholeSequences, apply_context_parallel
from foundry.distributed.env import all_reduce_sum, get_rank, get_world_size
from foundry.distributed.expert_parallel import shard_experts
from foundry.distributed.mesh import parallel_dims
from foundry.distributed.process_group import init_process_group
from foundry.errors import ConfigError
from foundry.schema import parse_dataclass

log = logging.getLogger(__name__)

# sharding_strategy -> (how ranks are laid out, reshard_after_forward)
STRATEGIES: dict[str, tuple[str, bool]] = {
    "FULL_SHARD": ("shard", True),
    "SHARD_GRAD_OP": ("shard", False),
    "HYBRID_SHARD": ("hybrid", True),
    "_HYBRID_SHARD_ZERO2": ("hybrid", False),
    "NO_SHARD": ("replicate", False),
}


@dataclasses.dataclass
class Placement:
    """What the loop needs from a placed model: when to reduce gradients, and how to split each batch."""

    accumulation: GradientAccumulation | None = None  # None: unsharded
    batches: ContextParallel | WholeSequences = dataclasses.field(default_factory=WholeSequences)


def parallelize(
    model: nn.Module,
    config: FSDPConfig,
    device: torch.device,
    precision: str,
    parallelism: ParallelismConfig | None = None,
) -> Placement:
    """Shard ``model`` over every rank as ``config`` (an ``FSDPConfig``) says; the process group must exist.

    Args:
        model: built on the CPU (every rank, same seed), on the meta device, or ``mixed``.
        config: ``fsdp_config``; ``model.config.activation_checkpointing_target`` picks what to checkpoint.
        device: this rank's device; the shards live there (on the CPU with ``cpu_offload``).
        precision: the run's precision; ``mixed_precision`` applies only to the amp precisions.
        parallelism: the mesh's degrees beyond data parallelism (``context_parallel_degree``,
            ``expert_parallel_degree``).

    Returns:
        How the model moves gradients and parameters between microbatches, and how batches are split.
    """
    layout, reshard_after_forward = STRATEGIES[config.sharding_strategy]
    parallelism = with_fsdp_aliases(parallelism or ParallelismConfig(), config)
    dims = parallel_dims(layout, parallelism)
    if not shards(config, device):  # one rank: parallel_dims refused any degree above 1
        _place_unsharded(model, config, device, precision)
        return Placement()
    mesh = dims.build_mesh(device.type)
    cp_attention = parallelism.context_parallel_attention
    batches = apply_context_parallel(model, mesh["cp"], cp_attention) if dims.cp > 1 else WholeSequences()
    rank0_weights = _rank0_weights(model, config.sync_module_states, device)
    expert_params = shard_experts(model, mesh.ep)  # FSDP leaves them be
    blocks = _wrap_blocks(model, config, device)
    offload = config.cpu_offload and device.type == "cuda"
    shard_settings = {
        "mesh": mesh.fsdp,
        "mp_policy": mixed_precision_policy(config.mixed_precision, precision),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        "ignored_params": expert_params or None,
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
    return Placement(GradientAccumulation(model, blocks, config, device), batches)  # type: ignore[arg-type]


# auto: what a batch's microbatches may hold beyond FSDP's shards, as a share of the device's memory
HELD_BETWEEN_MICROBATCHES_SHARE = 0.25


class GradientAccumulation:
    """When a sharded model, between the microbatches of one batch, reduces gradients and reshards parameters.

    Each FSDP2 reshard costs more than its all-gather: gathered parameters are copied out of the
    communication buffer, and the collective's kernels take SMs from the GEMMs beside them. So when the
    model is small for the device (two bf16 copies of it within a quarter of the device's memory:
    MPT-1B and -3B on an 80 GB GPU, not 7B), the default gathers each block once a batch, at its first
    forward, and keeps it gathered until the batch's last backward, and sums gradients unsharded,
    reducing them once a batch: on two H200s MPT-1B's batch took 4.3% less time than with FSDP2's
    own schedule (docs/PERFORMANCE.md). Larger models reshard after each forward and backward and reduce
    after each microbatch, as Composer does, so memory stays at FSDP's shards.
    ``reshard_between_microbatches`` and ``reduce_every_microbatch`` override either choice.
    """

    def __init__(
        self, model: FSDPModule, blocks: list[FSDPModule], config: FSDPConfig, device: torch.device | None = None
    ) -> None:
        self.model = model
        small = model_is_small_for(model, device)  # type: ignore[arg-type]
        reduce_every = config.reduce_every_microbatch
        reshard = config.reshard_between_microbatches
        self.reduce_every_microbatch = not small if reduce_every is None else reduce_every
        self.keep_gathered = small if reshard is None else not reshard
        if self.keep_gathered:  # only the batch's last backward reshards (state dicts reshard by themselves)
            for block in blocks:
                block.set_reshard_after_forward(False, recurse=False)

    def before_microbatch(self, last: bool) -> None:
        """Set up the next forward and backward; ``last``: the batch's last microbatch."""
        # Set every microbatch, not only on change: the microbatch-size trials turn gradient sync off between.
        self.model.set_requires_gradient_sync(last or self.reduce_every_microbatch)
        if self.keep_gathered:
            self.model.set_reshard_after_backward(last)


def model_is_small_for(model: nn.Module, device: torch.device | None, memory_bytes: int | None = None) -> bool:
    """Whether two bf16 copies of ``model`` (gathered parameters, unsharded gradient sums) fit in a quarter of
    ``device``'s memory (``memory_bytes`` if given). On the CPU the copies live in host memory: small."""
    if memory_bytes is None:
        if device is None or device.type != "cuda":
            return True
        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    parameters = sum(parameter.numel() for parameter in model.parameters())  # DTensors count their global size
    return 2 * 2 * parameters <= HELD_BETWEEN_MICROBATCHES_SHARE * memory_bytes


def shards(config: FSDPConfig, device: torch.device) -> bool:
    """Whether ``fully_shard`` is applied: with several ranks, or to offload parameters to the CPU."""
    return get_world_size() > 1 or (config.cpu_offload and device.type == "cuda")


def _wrap_blocks(model: nn.Module, config: FSDPConfig, device: torch.device) -> list[nn.Module]:
    """Activation checkpointing and activation offload around the blocks; returns the (wrapped) blocks."""
    blocks = fsdp_blocks(model)
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


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients across ranks (a no-op for an unsharded module).

    Gradient accumulation turns it off for all but a batch's last microbatch: FSDP2 then keeps
    the unsharded gradients and reduce-scatters (or all-reduces) their sum once per batch.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def mixed_precision_policy(mode: str, precision: str) -> MixedPrecisionPolicy:
    """``fsdp_config.mixed_precision`` as FSDP2 dtypes (as LLM Foundry maps it); fp32 runs stay fp32.

    PURE: compute and gradient reduction in the amp dtype. DEFAULT: compute in the amp dtype,
    reduction in fp32. FULL: both fp32 (autocast still runs matmuls in the amp dtype).
    The sharded parameters and the optimizer state stay fp32 in every mode.
    """
    low = compute_dtype(precision)
    if low is None or mode == "FULL":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low if mode == "PURE" else torch.float32)


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one at a time (each all-gathered just before it runs)."""
    if hasattr(model, "fsdp_wrap_modules"):
        return list(model.fsdp_wrap_modules())
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    no_split = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    return [module for module in model.modules() if type(module).__name__ in no_split]


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
) -> Placement:
    """Shard ``model`` onto ``device`` with FSDP2 over the mesh ``parallelism`` shapes, or move it there."""
    if fsdp_config is not None:
        return parallelize(model, fsdp_config, device, precision, parallelism)
    parallelism = parallelism or ParallelismConfig()
    parallel_dims("shard", parallelism)  # a degree above 1 needs as many ranks
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
