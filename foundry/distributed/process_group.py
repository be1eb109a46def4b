"""Join and leave the job's process group: NCCL between GPUs (gloo for CPU tensors), gloo on CPU machines.

torchrun (and ``foundry train --nproc N``, which runs torchrun) sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_process_group`` reads them. A process
started without them gets a group of one on an in-memory store, so FSDP2 (whose DeviceMesh needs a
process group) also runs on a single device.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from foundry.distributed.env import default_device, get_world_size, is_distributed
from foundry.errors import ConfigError


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a launched job (torchrun's rendezvous variables are set)."""
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


def init_process_group(timeout_s: float = 600.0) -> None:
    """Join the process group of this job (a no-op when already joined).

    Args:
        timeout_s: seconds a collective may wait for the other ranks before failing (``dist_timeout``).
    """
    if is_distributed():
        return
    device = default_device()
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo serves collectives on CPU tensors (e.g. CPU offload)
    timeout = datetime.timedelta(seconds=timeout_s)
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout)
        return
    if get_world_size() > 1:
        raise ConfigError(
            f"WORLD_SIZE is {get_world_size()} but MASTER_ADDR or RANK is not set, so this process cannot find the "
            "others. Launch with `foundry train --nproc N cfg.yaml` or `torchrun --nproc-per-node N -m foundry.cli "
            "train cfg.yaml`."
        )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def new_gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank, for collectives that run beside training's (a background checkpoint write).

    Joins the job's process group first (a group of one for a process started without torchrun).
    """
    init_process_group()
    return dist.new_group(backend="gloo")


def destroy_process_group() -> None:
    """Leave the process group (a no-op when there is none)."""
    if is_distributed():
        dist.destroy_process_group()
