"""The Trainer's checkpoint writes: one at a time, each published (and its event fired) once complete."""

from __future__ import annotations

from pathlib import Path

from foundry import distributed
from foundry.checkpoint.find import latest_checkpoint
from foundry.checkpoint.save import PendingCheckpoint, complete_publish, remove_temporaries, start_checkpoint
from foundry.core import Engine, Event
from foundry.core.paths import check_writable_folder


class CheckpointSaver:
    """Writes the run's checkpoints into ``save_folder`` (nothing without one) when the Trainer asks.

    Args:
        engine: fires BEFORE_CHECKPOINT, and the checkpoint event once the checkpoint is published;
            its state, callbacks and algorithms are what is saved.
        save_folder: where checkpoints go (checked to be writable now); None saves nothing. What
            interrupted saves left there (``.tmp-*``) is deleted now.
        overwrite / num_to_keep: ``start_checkpoint``'s options.
        save_async: write in a background thread (over a gloo group of its own) while training goes on;
            the checkpoint is published at the next save, at fit's end, or after an error.
        config: the resolved YAML, stored in each checkpoint.
    """

    def __init__(
        self,
        engine: Engine,
        save_folder: str | None,
        *,
        overwrite: bool,
        num_to_keep: int,
        save_async: bool,
        config: dict | None,
    ) -> None:
        self.engine, self.state = engine, engine.state
        self.save_folder = save_folder
        if save_folder:
            check_writable_folder(save_folder, "save_folder")  # on every rank: all of them stop, or none
            if self.state.rank == 0 and Path(save_folder).is_dir():
                remove_temporaries(Path(save_folder))
        self.overwrite, self.num_to_keep, self.config = overwrite, num_to_keep, config
        self._async_group = distributed.new_gloo_group() if save_async and save_folder else None
        self._pending: tuple[PendingCheckpoint, Event] | None = None  # and the event to fire when published
        self.last_save_batch: int | None = None

    def save(self, event: Event) -> None:
        """Start a checkpoint of the current state; ``event`` fires once it is published."""
        if not self.save_folder:
            return
        self.publish_pending()  # one write at a time
        self.engine.run_event(Event.BEFORE_CHECKPOINT)
        pending = start_checkpoint(
            self.save_folder,
            self.state,
            callbacks=self.engine.callbacks,
            algorithms=self.engine.algorithms,
            config=self.config,
            overwrite=self.overwrite,
            num_to_keep=self.num_to_keep,
            async_process_group=self._async_group,
        )
        self._pending = (pending, event)
        self.last_save_batch = self.state.timestamp.batch
        if self._async_group is None:
            self.publish_pending()

    def loaded(self, path: Path) -> None:
        """The run resumed from checkpoint ``path``: if it is one of ours, fit's end need not save that batch again.

        If it is our newest, rank 0 also completes its publish (``latest``, retention), which a kill right
        after its rename would have left undone.
        """
        if self.save_folder and path.parent.resolve() == Path(self.save_folder).resolve():
            self.last_save_batch = self.state.timestamp.batch
            newest = latest_checkpoint(self.save_folder)
            if self.state.rank == 0 and newest is not None and newest.resolve() == path.resolve():
                complete_publish(Path(self.save_folder), path.name, self.num_to_keep)

    def publish_pending(self) -> None:
        """Wait for the checkpoint being written, publish it and fire its checkpoint event."""
        if self._pending is None:
            return
        pending, event = self._pending
        self._pending = None
        self.state.last_checkpoint_path = str(pending.finish())
        self.engine.run_event(event)

    def settle_after_error(self) -> None:
        """After an exception, finish this rank's write; publish it only when no other rank must agree."""
        if self._pending is None:
            return
        pending, _ = self._pending
        self._pending = None
        if self.state.world_size == 1:
            self.state.last_checkpoint_path = str(pending.finish())
        else:
            pending.wait()  # peers may not reach a barrier: the folder stays temporary, the next save removes it
