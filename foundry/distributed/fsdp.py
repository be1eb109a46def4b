"""FSDP2's settings for foundry's sharded runs: the strategies, mixed precision, and accumulation between microbatches.

``foundry.distributed.placement`` applies them (``fully_shard`` per block, then the root); this module says
how: ``STRATEGIES`` maps ``fsdp_config.sharding_strategy`` to a rank layout and FSDP2's
``reshard_after_forward``, ``mixed_precision_policy`` maps ``mixed_precision`` to FSDP2's dtypes, and
``GradientAccumulation`` decides when gradients are reduced and parameters resharded within a batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from foundry.core.precision import compute_dtype
from foundry.distributed.config import FSDPConfig

# sharding_strategy -> (how ranks are laid out, reshard_after_forward)
STRATEGIES: dict[str, tuple[str, bool]] = {
    "FULL_SHARD": ("shard", True),
    "SHARD_GRAD_OP": ("shard", False),
    "HYBRID_SHARD": ("hybrid", True),
    "_HYBRID_SHARD_ZERO2": ("hybrid", False),
    "NO_SHARD": ("replicate", False),
}


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
