"""An end-of-run PNG of the run's own curves, drawn from what the JSONL logger wrote."""

from __future__ import annotations

import warnings
from pathlib import Path

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.errors import FoundryError
from foundry.loggers.jsonl import JSONLLogger
from foundry.plotting import plot_runs


@registry.callbacks.register("plot_curves")
class PlotCurves(Callback):
    """At FIT_END on rank 0, draws train loss, each eval loader's loss and tokens/s to ``<run_folder>/curves.png``.

    It reads the run's metrics.jsonl, so a resumed run's PNG shows the whole run. Without matplotlib
    (or without a JSONL logger) it warns once and training ends normally.

    Args:
        run_folder: where the PNG goes; default: the folder of the run's metrics.jsonl.
        file_name: the PNG's name.
    """

    def __init__(self, run_folder: str | None = None, file_name: str = "curves.png") -> None:
        self.run_folder = run_folder
        self.file_name = file_name
        self.out_path: Path | None = None  # the PNG, once drawn
        self._warned = False

    def fit_end(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        jsonl = next((d for d in logger.destinations if isinstance(d, JSONLLogger)), None)
        if jsonl is None:
            self._warn_once("plot_curves draws from metrics.jsonl, but the run has no jsonl logger; no PNG drawn.")
            return
        jsonl.flush()  # logger destinations run after callbacks: the last rows may still be buffered
        metrics = ["loss/train/total", *(f"metrics/{label}/loss" for label in state.eval_dataloaders)]
        out_path = Path(self.run_folder or jsonl.path.parent) / self.file_name
        try:
            self.out_path = plot_runs([jsonl.path], out_path, [*metrics, "throughput/tokens_per_sec"]).out_path
        except FoundryError as error:
            self._warn_once(f"plot_curves drew no PNG: {error}")
            return
        logger.log_text(f"Curves: {self.out_path}")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=2)
