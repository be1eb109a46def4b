"""TensorBoard: every metric as a scalar by step, the resolved config as text (``tensorboard --logdir runs``)."""

from __future__ import annotations

import os
from typing import Any

import yaml

from foundry import registry
from foundry.core.callback import LoggerDestination
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.redact import scrub_secrets
from foundry.core.state import State
from foundry.errors import ConfigError
from foundry.loggers.wandb import run_folder
from foundry.optional import import_optional


@registry.loggers.register("tensorboard")
class TensorboardLogger(LoggerDestination):
    """Writes a TensorBoard event file on rank 0; flushed at FIT_END and closed with the run.

    Args:
        log_dir: the event files' folder; default '<run_folder>/tensorboard'.
    """

    def __init__(self, log_dir: str | None = None) -> None:
        self._summary_writer_class = import_summary_writer()
        self.log_dir = log_dir
        self._rank = int(os.environ.get("RANK", "0"))  # until an event tells us state.rank
        self._writer: Any = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._rank = state.rank
        if self.log_dir is None:
            self.log_dir = str(run_folder(state) / "tensorboard")
        super().run_event(event, state, logger)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self._open()
        if writer is not None:
            for key, value in metrics.items():
                writer.add_scalar(key, value, global_step=step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        writer = self._open()
        if writer is not None:
            config_yaml = yaml.safe_dump(scrub_secrets(hyperparameters), sort_keys=False)
            # TensorBoard renders text as Markdown: a 4-space indent keeps the YAML a code block.
            writer.add_text("config", "".join(f"    {line}\n" for line in config_yaml.splitlines()), global_step=0)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> Any:
        """The rank-0 writer, created on first use (None on other ranks)."""
        if self._writer is None and self._rank == 0:
            # A log_dir of None here (no event seen yet) gets SummaryWriter's own default, runs/<date>_<host>.
            self._writer = self._summary_writer_class(log_dir=self.log_dir)
        return self._writer


def import_summary_writer() -> type:
    module = import_optional(
        "torch.utils.tensorboard",
        needed_for="loggers.tensorboard",
        package="the tensorboard package",
        install="pip install 'foundry[tensorboard]'",
        error=ConfigError,
    )
    return module.SummaryWriter
