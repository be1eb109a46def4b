"""Join and leave the job's process group: NCCL between GPUs (gloo for CPU tensors), gloo on CPU machines.

torchrun (and ``foundry train --nproc N``, which runs torchrun) sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_process_group`` reads them. A process
started without them gets a group of one on an in-memory store, so FSDP2 (whose DeviceMesh needs a
process group) also runs on a single device.

A job's start can hang at two stages after the rendezvous: the process group's start (gloo connects every pair of
ranks) and its first collective (NCCL connects there). Each gets the start timeout (the launcher's
``--rdzv-timeout-s``, at most ``dist_timeout``) and a ``TrainingError`` that names the stage and who did not come;
``dist_timeout`` applies from then on.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from foundry.distributed.env import all_gather_object, default_device, get_rank, get_world_size, is_distributed
from foundry.distributed.job import launched_by_torchrun
from foundry.distributed.rendezvous import DEFAULT_RDZV_TIMEOUT_S, NODE_RANK_VARIABLE, START_TIMEOUT_VARIABLE
from foundry.errors import ConfigError, LostRankError, TrainingError

# (host, pid, node rank) of every rank of the job, in rank order: how a survivor tells which peer died. The node
# rank is the launcher's --node-rank where it was given, else torchrun's number for the machine.
_rank_processes: list[tuple[str, int, int]] = []
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
        start_timeout_s = min(timeout_s, float(os.environ.get(START_TIMEOUT_VARIABLE, DEFAULT_RDZV_TIMEOUT_S)))
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=start_timeout_s))
        except Exception as error:
            raise _start_error(error, start_timeout_s) from error
        meet_every_rank(start_timeout_s)
        node = int(os.environ.get(NODE_RANK_VARIABLE) or os.environ.get("GROUP_RANK", 0))  # else torchrun's number
        _rank_processes[:] = all_gather_object((socket.gethostname(), os.getpid(), node))
        _set_timeout(timeout)
        return
    if get_world_size() > 1:
        raise ConfigError(
            f"WORLD_SIZE is {get_world_size()} but MASTER_ADDR or RANK is not set, so this process cannot find the "
            "others. Launch with `foundry train --nproc N cfg.yaml` or `torchrun --nproc-per-node N -m foundry.cli "
            "train cfg.yaml`."
        )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _start_error(error: Exception, timeout_s: float) -> TrainingError:
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return TrainingError(
        f"process-group start: rank {get_rank()} of {get_world_size()} could not connect to every other rank through "
        f"the store at {where} within {timeout_s:g} s: a rank did not start, or the machines cannot open connections "
        f"to each other (firewall, network interface). (torch said: {said[:300]})"
    )


def meet_every_rank(timeout_s: float) -> None:
    """The job's first collective, given ``timeout_s``: a TrainingError that names the ranks that did not come,
    where otherwise the first step of training would wait ``dist_timeout``."""
    if get_world_size() == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)  # on the group's gloo (CPU) backend
    except ValueError:  # a group without a CPU backend (torch 2.11 with cuda:nccl): a barrier, without names
        dist.barrier()
    except RuntimeError as error:
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(error))
        who = f"rank(s) {missing.group(1).strip()}" if missing else "rank 0, which checks the others,"
        raise TrainingError(
            f"first collective: {who} of {get_world_size()} did not arrive within {timeout_s:g} s (the start timeout, "
            "--rdzv-timeout-s): their processes hang or stopped before it. Their own output says why; relaunch every "
            "node once they are fixed."
        ) from error


def _set_timeout(timeout: datetime.timedelta) -> None:
    """``timeout`` for the collectives from here on (``dist.set_timeout`` since torch 2.12, before it private)."""
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout)


def rank_nodes() -> list[int]:
    """The node of each rank (its launcher's --node-rank, else torchrun's number), in rank order; empty before the
    group started."""
    return [node for _, _, node in _rank_processes]


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
    dead = _dead_ranks_here(host)
    elsewhere: dict[tuple[int, str], list[int]] = {}
    for rank, (where, _, node) in enumerate(_rank_processes):
        if where != host:
            elsewhere.setdefault((node, where), []).append(rank)
    if dead:
        nodes = sorted({_rank_processes[rank][2] for rank in dead})
        who = f"{_ranks_text(dead)} (node {', '.join(map(str, nodes))}, on this machine) died"
    elif elsewhere:
        machines = "; ".join(f"node {n} on {name}: {_ranks_text(ranks)}" for (n, name), ranks in elsewhere.items())
        who = f"the ranks of {'another machine' if len(elsewhere) == 1 else 'one of the other machines'} stopped "
        who += f"answering ({machines})"
    else:
        who = "another rank stopped answering"
    return LostRankError(
        f"Rank {me} of {len(_rank_processes)} lost contact with the other ranks: {who} (killed, out of host memory, "
        "or its machine failed), and the run cannot go on without it. Relaunch the same command: with autoresume: true "
        f"it continues from the last checkpoint in save_folder. (The collective said: {first_line.strip()[:200]})"
    )


def _dead_ranks_here(host: str, wait_s: float = 2.0) -> list[int]:
    """The ranks on this machine whose process is gone. A killed process closes its sockets while it exits, so
    its peer can hear of it a moment before it is dead: an empty answer is asked again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [rank for rank, (where, pid, _) in enumerate(_rank_processes) if where == host and not _alive(pid)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 1``, ``ranks 8-15`` (a run of consecutive ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"


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
