"""``foundry train --nproc N``: run N ranks on this machine (joining other machines' ranks) through torchrun.

The command re-runs itself as ``torchrun --nproc-per-node N ... -m foundry.cli train CFG ...``; each
rank then joins the process group from torchrun's environment. It exits with the ranks' common exit
code (3 when the run handed over, 2 for a config error), where plain torchrun would exit 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from foundry.errors import ConfigError


def launch(command: Sequence[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> int:
    """Run ``python -m foundry.cli *command`` as ``nproc`` local ranks of an ``nnodes``-node job.

    Args:
        command: the ``foundry`` arguments each rank runs, e.g. ``["train", "cfg.yaml", "max_duration=10ba"]``.
        nproc: ranks on this machine (usually its GPU count).
        nnodes: machines in the job; more than one needs ``rdzv_endpoint``.
        rdzv_endpoint: ``host:port`` that every machine reaches, where the ranks find each other.

    Returns:
        0, or the exit code every failed rank shared (1 when they differ).
    """
    arguments = torchrun_arguments(command, nproc, nnodes, rdzv_endpoint)
    try:
        torchrun.run(torchrun.get_args_parser().parse_args(arguments))
    except ChildFailedError as error:
        # A rank killed by a signal could say nothing itself; torchrun then stopped the others with SIGTERM.
        killed = sorted(
            (failure.timestamp, rank, failure.signal_name())
            for rank, failure in error.failures.items()
            if failure.exitcode < 0 and failure.signal_name() != "SIGTERM"
        )
        if killed:
            print(killed_rank_message(killed[0][1], nproc * nnodes, killed[0][2]), file=sys.stderr)
        return ranks_exit_code([failure.exitcode for failure in error.failures.values()])
    return 0


def check_local_ranks(nproc: int, device: str | None) -> None:
    """Refuse ``--nproc`` beyond one rank per GPU (per CPU core when the run is on the CPU), naming the count.

    Two ranks on one GPU fail in NCCL; ranks beyond the cores only take turns on them, slower than fewer
    ranks, until a collective times out. ``device``: the run's ``device`` key (None: a GPU if there is one).
    """
    gpus = torch.cuda.device_count() if device is None or not device.startswith("cpu") else 0
    if gpus:
        if nproc > gpus:
            raise ConfigError(
                f"--nproc {nproc} starts {nproc} ranks on this machine, which has {gpus} GPU(s): each rank needs a "
                f"GPU of its own. Use --nproc {gpus} or fewer, or add machines with --nnodes (docs/DISTRIBUTED.md)."
            )
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores:
        raise ConfigError(
            f"--nproc {nproc} starts {nproc} ranks on this machine's CPU, which has {cores} core(s) for this process "
            f"and no GPU{' in use (device: cpu)' if device else ''}: ranks beyond one per core only take turns on the "
            f"cores, slower than fewer ranks, until a collective times out. Use --nproc {cores} or fewer, or run on "
            "machines with GPUs (one rank per GPU)."
        )


def killed_rank_message(rank: int, world_size: int, signal_name: str) -> str:
    return (
        f"foundry: rank {rank} of {world_size} was killed ({signal_name}) and torchrun stopped the others. Relaunch "
        "the same command: with autoresume: true the run continues from the last checkpoint in save_folder."
    )


def torchrun_arguments(command: Sequence[str], nproc: int, nnodes: int, rdzv_endpoint: str | None) -> list[str]:
    """torchrun's command line for ``launch``."""
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc ({nproc}) and --nnodes ({nnodes}) must be at least 1.")
    arguments = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        # One endpoint serves one job, so a fixed id is enough (and needs no agreement between machines).
        arguments += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=foundry"]
    elif nnodes > 1:
        raise ConfigError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, an address every machine of the job reaches "
            "(e.g. the first node's hostname and a free port, like 29500)."
        )
    else:
        arguments.append("--standalone")  # one machine: torchrun picks a free local port
    return [*arguments, "-m", "foundry.cli", *command]


def ranks_exit_code(exit_codes: Sequence[int]) -> int:
    """The exit code the failed ranks share; ranks torchrun stopped afterwards (by a signal) do not count."""
    codes = {code for code in exit_codes if code > 0}
    return codes.pop() if len(codes) == 1 else 1
