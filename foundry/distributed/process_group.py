"""Join and leave the job's process group: NCCL between GPUs (gloo for CPU tensors), gloo on CPU machines.

torchrun (and ``foundry train --nproc N``, which runs torchrun) sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_process_group`` reads them. A process
started without them gets a group of one on an in-memory store, so FSDP2 (whose DeviceMesh needs a
process group) also runs on a single device.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from foundry.distributed.env import all_gather_object, default_device, get_rank, get_world_size, is_distributed
from foundry.distributed.job import launched_by_torchrun
from foundry.errors import ConfigError, LostRankError

# (host, pid) of every rank of the job, in rank order: how a survivor tells which peer died.
_rank_processes: list[tuple[str, int]] = []
# What gloo and NCCL say when the other end of a connection is gone.
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
    "remote process exited",
)


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
        _rank_processes[:] = all_gather_object((socket.gethostname(), os.getpid()))
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


@contextlib.contextmanager
def explain_lost_ranks() -> Iterator[None]:
    """Turn the error a collective raises when another rank died into a ``LostRankError`` that names it."""
    try:
        yield
    except Exception as exc:
        lost = lost_rank_error(exc)
        if lost is None:
            raise
        raise lost from exc


def lost_rank_error(exc: BaseException) -> LostRankError | None:
    """A ``LostRankError`` if ``exc`` (or what caused it) says a peer's connection is gone, else None."""
    if len(_rank_processes) < 2:
        return None
    causes, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        causes.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    first_line = next(
        (line for text in causes for line in text.splitlines() if any(p in line for p in _PEER_GONE)), None
    )
    if first_line is None:
        return None
    me, host = get_rank(), socket.gethostname()
    dead = [rank for rank, (where, pid) in enumerate(_rank_processes) if where == host and not _alive(pid)]
    elsewhere = sorted({where for where, _ in _rank_processes if where != host})
    if dead:
        who = f"rank {', '.join(map(str, dead))} (on this machine) died"
    elif elsewhere:
        who = f"a rank on another machine ({', '.join(elsewhere)}) stopped answering"
    else:
        who = "another rank stopped answering"
    return LostRankError(
        f"Rank {me} of {len(_rank_processes)} lost contact with the other ranks: {who} (killed, out of host memory, "
        "or its machine failed), and the run cannot go on without it. Relaunch the same command: with autoresume: true "
        f"it continues from the last checkpoint in save_folder. (The collective said: {first_line.strip()[:200]})"
    )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its launcher, does not)."""
    if Path("/proc/self/stat").exists():  # Linux: the state letter follows the command name in parentheses
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
