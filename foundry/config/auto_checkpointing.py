"""``fsdp_config.activation_checkpointing: auto``: checkpoint the fewest blocks that let a step fit the GPU.

A checkpointed block keeps only its input and runs its forward again in backward: a third more of its work.
Which blocks need it depends on the card: the dry run plans the Llama-8B shape at 8,192 tokens a microbatch on four
GPUs at 100.3 GiB a GPU with none checkpointed on a 141 GB card (within its 75%), and at 83.5 GiB on an 80 GB card,
where 19 of 32 bring it to 59.3 GiB.
``auto`` plans the job with the dry run (``foundry.config.dry_run``: the same placement, on torch's fake process
group) for this machine's world size and GPU memory, then checkpoints the first k blocks whole, k the smallest
whose planned peak stays within ``MEMORY_SHARE`` of the card. ``foundry train`` resolves it on every rank before
the process group starts (the dry run needs a process without one), and ``--dry-run`` shows the choice for the
``--gpu-memory-gib`` it is given. A Trainer built in Python takes ``true`` or ``false`` (and
``model.activation_checkpointing_target``); ``choose_checkpointing`` gives it the same choice from a TrainConfig.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

import torch

from foundry.config import TrainConfig
from foundry.config.build import check_auto_checkpointing, torch_device
from foundry.config.dry_run import GIB, dry_run
from foundry.distributed.env import (
    all_gather_object,
    default_device,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_world_size,
)
from foundry.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
# The planned peak against the card's memory. The plan came within 4% of the allocated peak on four H200s (128k,
# 256k, the 30B MoE: docs/PERFORMANCE.md "Four GPUs"), and the caching allocator then reserved up to 1.19x that.
MEMORY_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class CheckpointChoice:
    """What ``auto`` chose: ``checkpointed`` of ``blocks`` blocks, and the planned peak against the budget."""

    checkpointed: int
    blocks: int
    planned_bytes: int
    budget_bytes: int
    card_bytes: int

    @property
    def fits(self) -> bool:
        return self.planned_bytes <= self.budget_bytes

    @property
    def fits_card(self) -> bool:
        """Above the budget but within the card: the run is tighter than auto aims for, not out of memory (the
        Llama-8B shape at 2,048 tokens on two 80 GB cards plans 71.8 GiB and peaks at 69.6)."""
        return self.planned_bytes <= self.card_bytes

    def line(self) -> str:
        head = (
            f"activation_checkpointing auto: {self.checkpointed} of {self.blocks} blocks checkpointed; the step "
            f"plans at {self.planned_bytes / GIB:.1f} GiB a GPU, "
        )
        budget = f"the {MEMORY_SHARE:.0%} of the card auto keeps to ({self.budget_bytes / GIB:.1f} GiB)"
        if self.fits:
            return head + f"within {budget}"
        if self.fits_card:
            return head + f"above {budget} even with every block, within the card's {self.card_bytes / GIB:.1f} GiB"
        return (
            head + f"above the card's {self.card_bytes / GIB:.1f} GiB even with every block: it may run out of "
            "memory; lower device_train_microbatch_size, use bf16 optimizer moments (optimizer.moments_dtype), "
            "or spread the run over more GPUs"
        )


def wants_auto(cfg: TrainConfig) -> bool:
    return cfg.fsdp_config is not None and cfg.fsdp_config.activation_checkpointing == AUTO


def choose_checkpointing(
    cfg: TrainConfig, world_size: int, ranks_per_node: int, device_memory_gib: float
) -> tuple[TrainConfig, CheckpointChoice]:
    """``cfg`` with ``auto`` replaced by the fewest whole blocks checkpointed that fit, and the choice.

    Raises:
        ConfigError: ``auto`` beside a ``model.activation_checkpointing_target`` or an ``auto`` microbatch size,
            or a model or layout the dry run cannot plan.
    """
    check_auto_checkpointing(cfg)
    every_block = _with_checkpointing(cfg, True, None)
    try:
        plan = dry_run(every_block, world_size, ranks_per_node, device_memory_gib)
    except ConfigError as error:  # a layout the dry run cannot plan yet trains fine with a choice made by hand
        raise ConfigError(
            f"fsdp_config.activation_checkpointing is 'auto', which chooses by the dry run's plan of the step: {error} "
            "Or set activation_checkpointing to true or false, which needs no plan."
        ) from None
    fixed = plan.total_bytes - plan.memory_bytes["activations"]
    budget = int(MEMORY_SHARE * device_memory_gib * GIB)
    by_count = plan.activation_bytes_by_checkpointed
    fewest = next((k for k, activations in enumerate(by_count) if fixed + activations <= budget), plan.blocks)
    choice = CheckpointChoice(fewest, plan.blocks, fixed + by_count[fewest], budget, int(device_memory_gib * GIB))
    if fewest == 0:
        return _with_checkpointing(cfg, False, None), choice
    target = None if fewest == plan.blocks else {plan.block_class: f"first-{fewest}"}
    return _with_checkpointing(cfg, True, target), choice


def resolve_for_this_rank(cfg: TrainConfig) -> TrainConfig:
    """For ``foundry train``, before the process group starts: ``auto`` chosen for this machine (its world size
    from torchrun's variables, its GPU's memory or, without one, the host's shared by the node's ranks)."""
    if not wants_auto(cfg):
        return cfg
    ranks_per_node = get_local_world_size()
    memory_gib = device_memory_gib(torch_device(cfg.device) if cfg.device else default_device(), ranks_per_node)
    cfg, choice = choose_checkpointing(cfg, get_world_size(), ranks_per_node, memory_gib)
    if get_rank() == 0:  # a plan above the card even with every block checkpointed may run out of memory
        log.log(logging.INFO if choice.fits_card else logging.WARNING, "%s.", choice.line())
    return cfg


def check_ranks_agree(cfg: TrainConfig) -> None:
    """After the process group starts, in a run that resolved ``auto``: every rank chose alike. Ranks on GPUs of
    other sizes may not, and a block recomputed on some ranks only repeats, under context or expert parallelism,
    collectives the others never join: a hang, so a clear error instead."""
    mine = f"{cfg.fsdp_config.activation_checkpointing} {cfg.model.get('activation_checkpointing_target')}"
    choices = all_gather_object(mine)
    if len(set(choices)) > 1:
        by_rank = "; ".join(f"rank {rank}: {choice}" for rank, choice in enumerate(choices))
        raise ConfigError(
            "fsdp_config.activation_checkpointing is 'auto', and this job's ranks chose differently by their GPUs' "
            f"memory ({by_rank}). Set activation_checkpointing to the smallest GPU's choice, which `foundry train "
            "CFG --dry-run --gpu-memory-gib G` prints, so that every rank recomputes the same blocks."
        )


def device_memory_gib(device: torch.device, ranks_per_node: int) -> float:
    """The memory of this rank's GPU (``cuda`` without an index: the local rank's, which the process group makes
    current), or its share of the host's when it trains on the CPU."""
    if device.type == "cuda":  # ROCm's GPUs too
        index = device.index if device.index is not None else get_local_rank()
        torch.cuda.set_device(index)  # as the process group will: nothing lands on another rank's GPU
        return torch.cuda.get_device_properties(index).total_memory / GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / max(ranks_per_node, 1)


def _with_checkpointing(cfg: TrainConfig, on: bool, target: Any) -> TrainConfig:
    """A copy of ``cfg`` with the choice made: ``on`` or off, ``target`` the model's (None: every block)."""
    chosen = copy.copy(cfg)
    chosen.model = {key: value for key, value in cfg.model.items() if key != "activation_checkpointing_target"}
    if target is not None:
        chosen.model["activation_checkpointing_target"] = target
    keep_attention = on and cfg.fsdp_config.activation_checkpointing_keep_attention
    chosen.fsdp_config = dataclasses.replace(
        cfg.fsdp_config, activation_checkpointing=on, activation_checkpointing_keep_attention=keep_attention
    )
    return chosen
