"""``foundry train --nproc N``: run N ranks on this machine (joining other machines' ranks) through torchrun.

The command re-runs itself as ``torchrun --nproc-per-node N ... -m foundry.cli train CFG ...``; each
rank then joins the process group from torchrun's environment. With ``--nnodes`` the machines first meet at the
rendezvous endpoint (``foundry.distributed.rendezvous``); a rendezvous that times out, a store that is lost, or
another node that stops answering while the ranks train (this node's ranks are then stopped) ends in a
``TrainingError`` that says so, after what the ranks said. It exits with the ranks' common exit
code (3 when the run handed over, 5 when it was preempted, 2 for a config error), where plain torchrun
would exit 1.

Preemption: torchrun's agent runs in a thread of this process, so the launcher keeps its own signal
handlers. On SIGTERM or SIGUSR1 (what Slurm and Kubernetes send before SIGKILL) it forwards the signal
to its ranks, which checkpoint after the batch in progress and exit 5 (``foundry.checkpoint.preemption``);
it waits for them up to ``grace_period_s`` and then kills them (the last complete checkpoint stays).
SIGINT, SIGHUP and SIGQUIT are forwarded as they are. No traceback is printed either way. A second preemption
signal changes nothing: ``foundry train`` notes them from its start to its exit (``foundry.distributed.job``), so
the exit code stays 5 whenever it comes.

Errors are said once and last: the ranks hand their ``FoundryError`` to the launcher
(``foundry.distributed.job``), which prints each distinct message once after torchrun has exited;
torchrun's own lines about the ranks it stopped are left out, as this module reports the outcome itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from foundry.distributed.job import (
    PREEMPTION_SIGNALS,
    RANK_ERRORS_VARIABLE,
    SignalNote,
    rank_errors_folder_prefix,
    rank_errors_message,
    ranks_lost_contact,
)
from foundry.distributed.rendezvous import Nodes, NodeWatch, rendezvous_arguments, rendezvous_failure, store_lost
from foundry.errors import EXIT_PREEMPTED, ConfigError, LostRankError

FORWARDED_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_GRACE_PERIOD_S = 100.0  # below Slurm's --signal=B:TERM@120, so the launcher's line comes before SIGKILL
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C), as a shell reports it


def launch(command: Sequence[str], nodes: Nodes, grace_period_s: float = DEFAULT_GRACE_PERIOD_S) -> int:
    """Run ``python -m foundry.cli *command`` as ``nodes.nproc`` local ranks of a ``nodes.nnodes``-node job.

    Args:
        command: the ``foundry`` arguments each rank runs, e.g. ``["train", "cfg.yaml", "max_duration=10ba"]``.
        nodes: the job's machines (``foundry.distributed.rendezvous.job_nodes``); more than one meet at its endpoint.
        grace_period_s: after a preemption signal, how long the ranks may take to checkpoint and exit
            before they are killed.

    Returns:
        0, the exit code every failed rank shared (1 when they differ), ``EXIT_PREEMPTED`` (5) after a
        preemption signal, 130 after SIGINT.

    Raises:
        TrainingError: the machines did not meet (the rendezvous timed out); LostRankError: they lost their
            rendezvous store, or another node stopped answering.
    """
    nproc = nodes.nproc or 1
    arguments = torchrun.get_args_parser().parse_args(torchrun_arguments(command, nodes))
    failure: list[BaseException] = []

    def run_agent() -> None:
        try:
            torchrun.run(arguments)
        except BaseException as error:  # reported by the main thread
            failure.append(error)

    agent = threading.Thread(target=run_agent, name="torchrun-agent", daemon=True)
    with (
        _rank_errors_folder() as errors,
        _quiet_torchrun(nproc),
        _environment(nodes.rank_environment()),
        forwarding_signals(grace_period_s) as forwarded,
    ):
        started = forwarded.signal is None  # else a preemption signal came before the launch: start no rank
        if started:
            agent.start()
        with _watching_nodes(nodes) as lost_node:
            while agent.is_alive():
                agent.join(timeout=0.5)  # wakes up for the signal handlers, which run in this thread
        rank_errors, lost_contact = rank_errors_message(errors), ranks_lost_contact(errors)
    error = failure[0] if failure else None
    if isinstance(error, ChildFailedError) and lost_contact and forwarded.signal is None and store_lost(nodes):
        # The node hosting the store died: whether torchrun met the ranks' failure or the lost store first is a
        # race, and the launcher says the same either way.
        error = RendezvousConnectionError("the rendezvous store closed while the ranks trained")
    launcher_error = LostRankError(lost_node[0]) if lost_node else None
    if error is not None and not isinstance(error, ChildFailedError):
        launcher_error = launcher_error or rendezvous_failure(error, nodes) or error
    if launcher_error is not None:
        if rank_errors is not None:
            print(rank_errors, file=sys.stderr)  # what the ranks met first (a lost peer), before the launcher's own
        raise launcher_error
    if error is None and started:  # every rank finished (a signal that came during the last batch changes nothing)
        return 0
    exit_code = _exit_code(error, forwarded, nodes.world_size)
    if rank_errors is not None:
        print(rank_errors, file=sys.stderr)  # the last lines: torchrun's, and the ranks' own, came before
    return exit_code


def _exit_code(error: ChildFailedError | None, forwarded: ForwardedSignal, world_size: int) -> int:
    """The launcher's exit code for ranks that did not all finish; says what the ranks could not say themselves."""
    failures = error.failures if error is not None else {}
    exit_codes = [f.exitcode for f in failures.values()]
    if forwarded.signal in PREEMPTION_SIGNALS:
        return preempted_exit_code(forwarded, exit_codes)
    if forwarded.signal is not None:
        return EXIT_INTERRUPTED
    # A rank killed by a signal could say nothing itself; torchrun then stopped the others with SIGTERM.
    killed = sorted(
        (failure.timestamp, rank, failure.signal_name())
        for rank, failure in failures.items()
        if failure.exitcode < 0 and failure.signal_name() != "SIGTERM"
    )
    if killed:
        print(killed_rank_message(killed[0][1], world_size, killed[0][2]), file=sys.stderr)
    return ranks_exit_code(exit_codes)


@contextlib.contextmanager
def _watching_nodes(nodes: Nodes, interval_s: float = 5.0) -> Iterator[list[str]]:
    """While inside, a thread looks at the other nodes every ``interval_s`` (``NodeWatch``); once one is lost, it
    kills this node's ranks (waiting in a collective for the lost one's) and the list yields its description."""
    lost: list[str] = []
    done = threading.Event()

    def watch() -> None:
        nodes_watch = NodeWatch(nodes)
        while not done.wait(interval_s):
            found = nodes_watch.lost_node()
            if found is not None:
                lost.append(found)
                _signal_ranks(signal.SIGKILL)
                return

    if nodes.nnodes > 1:
        threading.Thread(target=watch, name="foundry-node-watch", daemon=True).start()
    try:
        yield lost
    finally:
        done.set()


class ForwardedSignal:
    """What ``forwarding_signals`` did: the first signal it forwarded, and whether the grace period ran out."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.ranks_killed = False


@contextlib.contextmanager
def forwarding_signals(grace_period_s: float) -> Iterator[ForwardedSignal]:
    """While inside, ``FORWARDED_SIGNALS`` go to this process's ranks; after a preemption signal the ranks are
    killed once ``grace_period_s`` has passed."""
    forwarded = ForwardedSignal()
    deadline: list[threading.Timer] = []

    def kill_ranks() -> None:
        forwarded.ranks_killed = True
        _signal_ranks(signal.SIGKILL)

    def forward(number: int, frame: Any) -> None:
        del frame
        received = signal.Signals(number)
        forwarded.signal = forwarded.signal or received
        _signal_ranks(received)
        if received in PREEMPTION_SIGNALS and not deadline:
            deadline.append(threading.Timer(grace_period_s, kill_ranks))
            deadline[0].daemon = True
            deadline[0].start()

    previous = {number: signal.signal(number, forward) for number in FORWARDED_SIGNALS}
    for number in PREEMPTION_SIGNALS:  # one that `foundry train` noted before the launch counts as forwarded
        noted = previous[number]
        if isinstance(noted, SignalNote) and noted.received:
            forwarded.signal = forwarded.signal or signal.Signals(noted.received)
    try:
        yield forwarded
    finally:
        for number, handler in previous.items():
            if isinstance(handler, SignalNote) and forwarded.signal in PREEMPTION_SIGNALS:
                handler.received = forwarded.signal  # preempted: `foundry train` ignores later ones to its exit
            signal.signal(number, handler)
        for timer in deadline:
            timer.cancel()


def preempted_exit_code(forwarded: ForwardedSignal, exit_codes: Sequence[int]) -> int:
    """``EXIT_PREEMPTED`` unless a rank failed for a reason of its own (then its code); says what happened to the
    ranks that could not say it themselves."""
    own_failures = {code for code in exit_codes if code > 0 and code != EXIT_PREEMPTED}
    if own_failures:
        return ranks_exit_code(exit_codes)
    name = forwarded.signal.name
    if forwarded.ranks_killed:
        print(
            f"foundry: {name}: the ranks did not checkpoint within the grace period (--grace-period-s) and were "
            "killed; the last complete checkpoint in save_folder stays. Relaunch to continue from it.",
            file=sys.stderr,
        )
    elif EXIT_PREEMPTED not in exit_codes:
        print(
            f"foundry: {name} stopped the ranks before training started, so there was nothing new to checkpoint. "
            "Relaunch to continue.",
            file=sys.stderr,
        )
    return EXIT_PREEMPTED


def _signal_ranks(number: signal.Signals) -> None:
    """Send ``number`` to this process's ranks: its children that run ``foundry.cli`` (torchrun starts them)."""
    for pid in _rank_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)


def _rank_pids() -> list[int]:
    """The pids of this process's children that run ``foundry.cli`` (read from /proc: Linux)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"foundry.cli" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
    return pids


# What torchrun logs about its ranks that this launcher reports itself, or that is no news to a user.
_TORCHRUN_NOISE = (
    "child thread",  # it runs in a thread and registers no signal handlers: on purpose, this launcher handles them
    "failed (exitcode",  # a rank failed: the rank said why, and the launcher's exit code and last line say it again
    "closing signal",  # it stops the other ranks after one failed
    "Closing process",
    "failed to shutdown the rendezvous",  # its store is gone: the launcher's own last line says so
)
_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
)


class _TorchrunNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _TORCHRUN_NOISE)


@contextlib.contextmanager
def _quiet_torchrun(nproc: int) -> Iterator[None]:
    """Without torchrun's lines in ``_TORCHRUN_NOISE``, nor its banner about OMP_NUM_THREADS: with several ranks
    per machine each gets 1 thread unless OMP_NUM_THREADS says otherwise, set here as torchrun would set it."""
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet = _TorchrunNoise()
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in _TORCHRUN_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)


@contextlib.contextmanager
def _rank_errors_folder() -> Iterator[Path]:
    """A folder the ranks write their errors into (``foundry.distributed.job``), named in their environment."""
    with (
        tempfile.TemporaryDirectory(prefix=rank_errors_folder_prefix(os.getpid())) as folder,
        _environment({RANK_ERRORS_VARIABLE: folder}),
    ):
        yield Path(folder)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in this process's environment while inside (torchrun starts the ranks with it)."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def torchrun_arguments(command: Sequence[str], nodes: Nodes) -> list[str]:
    """torchrun's command line for ``launch``."""
    arguments = [f"--nproc-per-node={nodes.nproc or 1}", f"--nnodes={nodes.nnodes}", *rendezvous_arguments(nodes)]
    return [*arguments, "-m", "foundry.cli", *command]


def ranks_exit_code(exit_codes: Sequence[int]) -> int:
    """The exit code the failed ranks share; ranks torchrun stopped afterwards (by a signal) do not count."""
    codes = {code for code in exit_codes if code > 0}
    return codes.pop() if len(codes) == 1 else 1
