"""Record every CUDA allocation and free over a few batches, for https://pytorch.org/memory_viz.

The pickle is torch's memory snapshot (drag it onto pytorch.org/memory_viz); the HTML next to it is
the same timeline, self-contained. Recording slows the recorded batches (a stack trace per
allocation), so it covers a few batches once, after the first batch has warmed up.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.paths import run_subfolder
from foundry.core.state import State
from foundry.core.time import Time, TimeUnit
from foundry.errors import ConfigError


@registry.callbacks.register("memory_snapshot")
class MemorySnapshot(Callback):
    """Writes ``rank{r}.batch{first}-{last}.pickle`` (and ``.html``) per recording into ``folder``.

    Batches are numbered as on the console (the first is 1). One recording covers ``interval``
    batches starting at batch ``skip_batches + 1``, or at each batch listed in ``batches``. On a
    device other than CUDA it warns once and does nothing.

    Args:
        skip_batches: Batches before the recording starts (the first pays for compilation and lazy init).
        interval: Batches one recording spans, e.g. '3ba'.
        batches: Start a recording at each of these batches instead of after ``skip_batches``.
        max_entries: Allocation events kept per recording (the oldest are dropped).
        folder: Where files go; ``{run_folder}`` and ``{run_name}`` are filled in.
    """

    def __init__(
        self,
        skip_batches: int = 1,
        interval: str | int | Time = "3ba",
        batches: list[int] | None = None,
        max_entries: int = 100_000,
        folder: str = "{run_folder}/memory_snapshots",
    ) -> None:
        span = Time.parse(interval)
        if span.unit != TimeUnit.BATCH or span.value < 1:
            raise ConfigError(
                f"callbacks.memory_snapshot.interval is '{interval}'; give a whole number of batches such as '3ba'."
            )
        if skip_batches < 0 or any(batch < 1 for batch in batches or []):
            raise ConfigError(
                "callbacks.memory_snapshot: skip_batches must be >= 0 and every entry of batches >= 1 "
                f"(got skip_batches {skip_batches}, batches {batches})."
            )
        self.start_batches = sorted(set(batches)) if batches else [skip_batches + 1]
        self.interval_batches = int(span.value)
        self.max_entries = max_entries
        self.folder = folder
        self.written: list[Path] = []  # every file written, for tests and the log
        self._enabled = True
        self._recording_since: int | None = None  # the first batch of the recording in progress

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.device.type != "cuda" and self._enabled:
            self._enabled = False
            warnings.warn(
                f"memory_snapshot records CUDA allocations and this run is on '{state.device}'; it writes "
                "nothing. Remove it from callbacks to silence this warning.",
                stacklevel=2,
            )

    def batch_start(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch + 1  # the batch about to train
        if self._enabled and self._recording_since is None and batch in self.start_batches:
            torch.cuda.memory._record_memory_history(enabled="all", max_entries=self.max_entries)
            self._recording_since = batch

    def batch_end(self, state: State, logger: Logger) -> None:
        first = self._recording_since
        if first is None or state.timestamp.batch < first + self.interval_batches - 1:
            return
        snapshot = torch.cuda.memory._snapshot()  # what _dump_snapshot pickles; taken once for both files
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording_since = None
        self._write(state, logger, snapshot, f"rank{state.rank}.batch{first}-{state.timestamp.batch}")

    def close(self) -> None:
        if self._recording_since is not None:  # the run ended mid-recording: stop paying for it
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_since = None

    def _write(self, state: State, logger: Logger, snapshot: dict, stem: str) -> None:
        folder = run_subfolder(self.folder, state.run_folder, state.run_name)
        folder.mkdir(parents=True, exist_ok=True)
        pickle_path = folder / f"{stem}.pickle"
        with open(pickle_path, "wb") as file:
            pickle.dump(snapshot, file)
        self.written.append(pickle_path)
        try:
            from torch.cuda._memory_viz import trace_plot  # private to torch: a build may lack it

            html_path = folder / f"{stem}.html"
            html_path.write_text(trace_plot(snapshot))
            self.written.append(html_path)
        except (ImportError, ValueError) as error:  # ValueError: nothing was allocated while recording
            warnings.warn(f"memory_snapshot wrote {pickle_path} but no HTML trace ({error}).", stacklevel=2)
        logger.log_text(f"Memory snapshot: {pickle_path} (open it at https://pytorch.org/memory_viz)")
