"""Metrics as JSON lines: one object per ``log_metrics`` call, easy to read back and plot.

The file holds two kinds of line::

    {"hyperparameters": {...}}                      # once per log_hyperparameters call
    {"step": 20, "loss/train/total": 3.21, ...}     # once per log_metrics call

Read it back with ``[json.loads(line) for line in open(path)]`` or
``pandas.read_json(path, lines=True)`` (drop the hyperparameter rows with ``df[df.step.notna()]``).
Non-finite values (a NaN loss) are written as ``null`` so every line is strict JSON.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from foundry import registry
from foundry.core.callback import LoggerDestination
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.errors import TrainingError


@registry.loggers.register("jsonl")
class JSONLLogger(LoggerDestination):
    """Appends metrics to ``path`` (parent folders are created); an existing file is continued, as on resume.

    Lines are buffered and flushed at BATCH_END, EVAL_END and FIT_END, so a crash loses at most one batch, and
    before each checkpoint (BEFORE_CHECKPOINT), so a run resumed from a checkpoint has every line of the batches
    it holds. A resumed run drops the lines of the batches after its checkpoint, which it trains again (a run
    restarted from scratch, all of them): each batch has its line once.

    Args:
        path: The file to append to, e.g. '{run_folder}/metrics.jsonl'.
        all_ranks: Write on every rank, rank r > 0 to '<stem>.rank<r><suffix>' beside ``path``;
            by default only rank 0 writes.
    """

    def __init__(self, path: str, all_ranks: bool = False) -> None:
        self.path = Path(path)
        self.all_ranks = all_ranks
        self._rank = int(os.environ.get("RANK", "0"))  # until an event tells us state.rank
        self._file: TextIO | None = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._rank = state.rank
        super().run_event(event, state, logger)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, **{key: _finite_or_none(value) for key, value in metrics.items()}})

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._write({"hyperparameters": hyperparameters})

    def after_load(self, state: State, logger: Logger) -> None:
        # Also at batch 0: a run killed before its first checkpoint restarts from scratch and logs those batches again.
        self._drop_lines_after(state.timestamp.batch)

    def batch_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def before_checkpoint(self, state: State, logger: Logger) -> None:
        self.flush()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            with self._disk_errors():
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def rank_path(self) -> Path:
        """The file this rank writes."""
        if self._rank == 0:
            return self.path
        return self.path.with_name(f"{self.path.stem}.rank{self._rank}{self.path.suffix}")

    def _write(self, row: dict[str, Any]) -> None:
        if self._rank != 0 and not self.all_ranks:
            return
        if self._file is None:
            self.rank_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.rank_path.open("a", encoding="utf-8")
        # default=str: hyperparameters may hold Time, Path or other non-JSON values.
        with self._disk_errors():
            self._file.write(json.dumps(row, default=str) + "\n")

    def _drop_lines_after(self, batch: int) -> None:
        """Rewrite the file without the metrics of batches after ``batch`` (a killed run logged them, and the
        resumed run trains them again)."""
        path = self.rank_path
        if (self._rank != 0 and not self.all_ranks) or not path.is_file():
            return
        self.close()
        lines = path.read_bytes().splitlines(keepends=True)
        kept = [line for line in lines if _kept(line, batch)]
        if len(kept) == len(lines):
            return
        partial = path.with_name(f".tmp-{path.name}")
        with self._disk_errors():
            partial.write_bytes(b"".join(kept))
            os.replace(partial, path)

    @contextlib.contextmanager
    def _disk_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            reason = "no space left on device" if error.errno == errno.ENOSPC else (error.strerror or str(error))
            raise TrainingError(
                f"Cannot write metrics to {self.rank_path}: {reason} (in {self.rank_path.parent}). Free space there "
                "or set run_folder to another disk, then relaunch: with autoresume: true the run continues from its "
                "last checkpoint."
            ) from None


def _kept(line: bytes, batch: int) -> bool:
    """Whether a resumed run at ``batch`` keeps ``line``: not one of a later batch's, nor one a kill cut short."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    step = row.get("step") if isinstance(row, dict) else None
    return not isinstance(step, int) or step <= batch


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
