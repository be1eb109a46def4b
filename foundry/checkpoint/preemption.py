"""Preemption: on SIGTERM or SIGUSR1 a run finishes its batch, checkpoints and stops, so a relaunch loses nothing.

Schedulers stop a job with SIGTERM (Slurm's ``scancel`` and preemption, Kubernetes, spot reclaim; Slurm
sends the signal of ``--signal`` first) and SIGKILL after a grace period. While ``fit()`` runs, the
Trainer notes either signal instead of dying. At the end of the batch in progress the ranks agree (one
all-reduce of a CPU integer per batch, which gloo serves, on several ranks), so they all stop after the
same batch; fit's end then writes the checkpoint through the same path as a periodic save (uploads
included) and skips the final evaluation. ``foundry train`` prints one line and exits with
``EXIT_PREEMPTED`` (5). If SIGKILL comes first, the last complete checkpoint stays intact: saves are
crash-consistent. ``foundry train --nproc`` forwards the signal to its ranks (``foundry.distributed.launch``).
``foundry train`` notes the signals from its start to its exit: one that comes before fit() stops the run after
its first batch, and one after fit() (a scheduler's second SIGTERM) changes nothing, so the exit code stays 5.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from foundry.checkpoint.kill_points import kill_point
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.distributed.job import PREEMPTION_SIGNALS, SignalNote


class Preemption(Callback):
    """The Trainer's own callback: stop after the batch in progress once a preemption signal arrived."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the signal this launch stopped for
        self.stopped_at: int | None = None  # the batch it stopped after
        self._received = 0  # the number of the last signal received, written by the handler
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._several_ranks = False
        self._group: dist.ProcessGroup | None = None  # None: the default group, which serves CPU tensors

    def fit_start(self, state: State, logger: Logger) -> None:
        self._received, self.signal_name, self.stopped_at = 0, None, None
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for number in PREEMPTION_SIGNALS:
                previous = self._previous_handlers[number] = signal.signal(number, self._note_signal)
                if isinstance(previous, SignalNote) and previous.received:  # `foundry train` noted it before fit
                    self._received, previous.received = previous.received, 0
        self._several_ranks = state.world_size > 1
        if self._several_ranks and self._group is None and "gloo" not in str(dist.get_backend()):
            self._group = dist.new_group(backend="gloo")  # a caller's NCCL-only group has no CPU collectives

    def _note_signal(self, number: int, frame: Any) -> None:
        del frame
        self._received = number  # a second signal (the launcher's, torchrun's) changes nothing

    def batch_end(self, state: State, logger: Logger) -> None:
        kill_point("train.batch_end")
        received = self._agreed_signal()
        if not received or state.stop_reason is not None or state.reached(state.max_duration):
            return
        self.signal_name = signal.Signals(received).name
        self.stopped_at = state.timestamp.batch
        state.stop_reason = f"preempted by {self.signal_name} at batch {self.stopped_at}"
        logger.log_text(f"Received {self.signal_name}: checkpointing at batch {self.stopped_at} and stopping.")

    def _agreed_signal(self) -> int:
        """The signal any rank received (every rank calls this after each batch), or 0."""
        if not self._several_ranks:
            return self._received
        flag = torch.tensor([self._received], dtype=torch.int64)  # on the CPU: gloo, no wait for the device
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.stopped_at is not None and self._several_ranks:
            dist.barrier(group=self._group)  # the ranks exit together: torchrun stops the slower ones otherwise
        self.close()

    def close(self) -> None:
        for number, handler in self._previous_handlers.items():
            if isinstance(handler, SignalNote) and self._received:
                handler.armed = True  # preempted: a later signal (the scheduler's second) changes nothing
                handler.received = self._received
            signal.signal(number, handler)
        self._previous_handlers.clear()


def preemption_of(callbacks: Sequence[Callback]) -> Preemption | None:
    """The ``Preemption`` among ``callbacks`` if a signal stopped this launch, else None."""
    for callback in callbacks:
        if isinstance(callback, Preemption) and callback.stopped_at is not None:
            return callback
    return None
