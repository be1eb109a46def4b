"""Metrics as JSON lines: one object per ``log_metrics`` call, easy to read back and plot.

The file holds two kinds of line::

    {"hyperparameters": {...}}                      # once per log_hyperparameters call
    {"step": 20, "loss/train/total": 3.21, ...}     # once per log_metrics call

Read it back with ``[json.loads(line) for line in open(path)]`` or
``pandas.read_json(path, lines=True)`` (drop the hyperparameter rows with ``df[df.step.notna()]``).
Non-finite values (a NaN loss) are written as ``null`` so every line is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from foundry import registry
from foundry.core.callback import LoggerDestination
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State


@registry.loggers.register("jsonl")
class JSONLLogger(LoggerDestination):
    """Appends metrics to ``path`` (parent folders are created); an existing file is continued, as on resume.

    Lines are buffered and flushed at BATCH_END, EVAL_END and FIT_END, so a crash loses at most one batch.

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

    def batch_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
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
        self._file.write(json.dumps(row, default=str) + "\n")


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
