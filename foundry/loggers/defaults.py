"""The loggers every run gets unless it passes its own: the console, and ``metrics.jsonl`` in the run folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from foundry.core import LoggerDestination, Time
from foundry.loggers.console import ConsoleLogger
from foundry.loggers.jsonl import JSONLLogger


def default_loggers(
    given: Sequence[LoggerDestination],
    run_folder: Path,
    log_to_console: bool,
    progress_bar: bool | None,
    console_log_interval: str | Time | int,
) -> list[LoggerDestination]:
    """The console and ``<run_folder>/metrics.jsonl`` loggers, unless ``given`` already has one of each kind."""
    defaults: list[LoggerDestination] = []
    if log_to_console and not any(isinstance(d, ConsoleLogger) for d in given):
        defaults.append(ConsoleLogger(progress_bar=progress_bar, log_interval=console_log_interval))
    if not any(isinstance(d, JSONLLogger) for d in given):
        defaults.append(JSONLLogger(path=str(run_folder / "metrics.jsonl")))
    return defaults
