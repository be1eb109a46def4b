"""What a process of ``foundry train`` knows of its job before torch loads: whether torchrun started it, the
preemption signals it notes, where it hands its error to its launcher, and that it dies with its launcher.

Signals: ``foundry train`` notes SIGTERM and SIGUSR1 from its start to its exit (``preemption_signals_noted``);
the Trainer's ``Preemption`` callback (``foundry.checkpoint.preemption``) and the launcher's forwarding
(``foundry.distributed.launch``) take over while they run and read what was noted before them, so a second
signal changes nothing and the exit code stays 5.

Errors, said once and last: every rank usually meets the same error (the same config, the same missing
folder), so printed by each it would appear N times, followed by torchrun's own lines. The launcher sets
``RANK_ERRORS_VARIABLE`` to a folder; a rank writes ``rank-<RANK>.json`` there (``hand_to_launcher``), and
the launcher prints each distinct message once after torchrun exits (``rank_errors_message``). A rank started
by plain ``torchrun`` prints its error itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foundry.errors import FoundryError, LostRankError


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a launched job (torchrun's rendezvous variables are set)."""
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


# ----------------------------------------------------------------------------------------------- signals
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a rank checkpoints and stops (exit 5)


class SignalNote:
    """A handler that notes a preemption signal instead of dying of it: ``received`` is the last one's number, or
    that of the signal the run stopped for, once the handlers that took over gave it back.

    A rank under torchrun still dies of one until ``armed`` (once its run was preempted): before that, a SIGTERM
    is torchrun stopping it after another rank failed, and must stop it at once, as the default handler does.
    """

    def __init__(self) -> None:
        self.received = 0
        self.armed = not launched_by_torchrun()

    def __call__(self, number: int, frame: Any) -> None:
        del frame
        if not self.armed:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received = number


@contextlib.contextmanager
def preemption_signals_noted(restore: bool = True) -> Iterator[SignalNote]:
    """While inside, ``PREEMPTION_SIGNALS`` are noted, never fatal; ``foundry train`` stays inside from its start to
    its exit. ``Preemption`` (during fit) and ``forwarding_signals`` (while ranks run) take over and read what was
    noted before them; a signal after them (a scheduler's second SIGTERM while the checkpoint is written or the
    process exits) changes nothing, so the exit code stays 5. ``restore``: give the previous handlers back at the
    end (False where the process exits right after, so no late signal finds the default handler that dies of it).
    """
    note = SignalNote()
    if threading.current_thread() is not threading.main_thread():  # Python runs handlers in the main thread only
        yield note
        return
    previous = {number: signal.signal(number, note) for number in PREEMPTION_SIGNALS}
    try:
        yield note
    finally:
        for number, handler in previous.items():
            if restore:
                signal.signal(number, handler)
            elif note.received:  # preempted: ignored to the end, as Python's shutdown resets its own handlers
                signal.signal(number, signal.SIG_IGN)


# ------------------------------------------------------------------------------------------------ errors
RANK_ERRORS_VARIABLE = "FOUNDRY_RANK_ERRORS"  # the folder the launcher reads its ranks' errors from


def rank_errors_folder_prefix(launcher_pid: int) -> str:
    """The name a launcher's folder starts with: its ranks (its children) know it by their parent's pid."""
    return f"foundry-rank-errors-{launcher_pid}-"


def hand_to_launcher(error: Exception) -> bool:
    """Write ``error`` where this rank's launcher reads it; False when this process is no rank of a launcher
    (then it prints its error), as a command that a rank runs in its turn is not.

    An error outside foundry's family (a bug, a library's internal error) goes with its type; the rank prints its
    traceback too. Handed over, it stays the cause the launcher names, whatever its peers then say.
    """
    folder = os.environ.get(RANK_ERRORS_VARIABLE)
    if not folder or not Path(folder).name.startswith(rank_errors_folder_prefix(os.getppid())):
        return False
    rank = int(os.environ.get("RANK", 0))
    message = str(error) if isinstance(error, FoundryError) else f"{type(error).__name__}: {error} (traceback above)"
    report = {"rank": rank, "message": message, "lost_rank": isinstance(error, LostRankError)}
    try:
        (Path(folder) / f"rank-{rank}.json").write_text(json.dumps(report))
    except OSError:
        return False
    return True


def ranks_lost_contact(folder: Path) -> bool:
    """Whether a rank in ``folder`` stopped because it lost contact with another (a ``LostRankError``)."""
    return any(report["lost_rank"] for report in _rank_reports(folder))


def _rank_reports(folder: Path) -> list[dict[str, Any]]:
    reports = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a rank killed while it wrote: torchrun's exit code tells the rest
    return reports


def rank_errors_message(folder: Path) -> str | None:
    """The ranks' errors in ``folder``, each distinct message once: ``error: ...`` when they all said the same,
    else one ``error (ranks 0, 1): ...`` line each, the cause last. None: no error.

    A peer's "lost contact" echo guesses why the other rank went away (killed, out of memory); when that rank
    said its own error, the echo is cut to who stopped, so the guess does not stand beside the cause."""
    by_message: dict[str, list[int]] = {}
    lost_rank: set[str] = set()
    for report in _rank_reports(folder):
        by_message.setdefault(report["message"], []).append(report["rank"])
        if report["lost_rank"]:
            lost_rank.add(report["message"])
    if not by_message:
        return None
    if len(by_message) == 1:
        return f"error: {next(iter(by_message))}"
    lines = []
    causes = {message: ranks for message, ranks in by_message.items() if message not in lost_rank}
    if causes and lost_rank:
        echoes = [rank for message in lost_rank for rank in by_message[message]]
        lines.append(f"{_ranks_text(echoes)} stopped: lost contact with a rank that failed (below)")
        by_message = causes
    for message, ranks in sorted(by_message.items(), key=lambda item: min(item[1])):
        lines.append(f"error ({_ranks_text(ranks)}): {message}")
    return "\n".join(lines)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def stop_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when its launcher dies (Linux; a no-op for ranks of plain torchrun).

    A launcher killed on its own (SIGKILL, the OOM killer) would leave its ranks training on with the other
    machines' and nothing watching them; dying with it, they are a lost node, which the others name and stop for.
    """
    launcher = os.getppid()
    folder = os.environ.get(RANK_ERRORS_VARIABLE)
    if not sys.platform.startswith("linux") or not folder:
        return
    if not Path(folder).name.startswith(rank_errors_folder_prefix(launcher)):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the kernel was told
        os.kill(os.getpid(), signal.SIGKILL)
