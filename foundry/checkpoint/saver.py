"""The Trainer's checkpoint writes: one at a time, each published (and its event fired) once complete.

A save_folder on an object store is written in its local copy, and each checkpoint published there is
then uploaded in the background (``foundry.checkpoint.uploader``).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from foundry import distributed
from foundry.checkpoint.find import checkpoint_folders, latest_checkpoint
from foundry.checkpoint.object_store import ObjectStore, object_store
from foundry.checkpoint.remote import published_checkpoints, remove_unpublished, store_checkpoints
from foundry.checkpoint.save import PendingCheckpoint, complete_publish, remove_temporaries, start_checkpoint
from foundry.checkpoint.uploader import CheckpointUploader
from foundry.core import Engine, Event
from foundry.core.paths import check_writable_folder, is_object_store_url, local_copy
from foundry.errors import CheckpointError


class CheckpointSaver:
    """Writes the run's checkpoints into ``save_folder`` (nothing without one) when the Trainer asks.

    Args:
        engine: fires BEFORE_CHECKPOINT, and the checkpoint event once the checkpoint is published;
            its state, callbacks and algorithms are what is saved.
        save_folder: where checkpoints go (checked to be writable now); None saves nothing. What
            interrupted saves left there (``.tmp-*``) is deleted now. An object-store URL (``s3://...``):
            checkpoints are written in its local copy and uploaded; what interrupted uploads left there,
            and local checkpoints the store has not published, are deleted now.
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
        self.local_folder = Path(local_copy(save_folder) if is_object_store_url(save_folder) else save_folder or ".")
        self.overwrite, self.num_to_keep, self.config = overwrite, num_to_keep, config
        self.uploader: CheckpointUploader | None = None
        self._first_sequence = 1
        if save_folder:
            check_writable_folder(self.local_folder, "save_folder")  # on every rank: all of them stop, or none
            if self.state.rank == 0 and self.local_folder.is_dir():
                remove_temporaries(self.local_folder)
            if is_object_store_url(save_folder):
                self._start_uploads(object_store(save_folder))
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
            self.local_folder,
            self.state,
            callbacks=self.engine.callbacks,
            algorithms=self.engine.algorithms,
            config=self.config,
            overwrite=self.overwrite,
            num_to_keep=-1 if self.uploader else self.num_to_keep,  # the uploader prunes once the store has published
            async_process_group=self._async_group,
            first_sequence=self._first_sequence,
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
        if self.save_folder and path.parent.resolve() == self.local_folder.resolve():
            self.last_save_batch = self.state.timestamp.batch
            newest = latest_checkpoint(self.local_folder)
            if self.state.rank == 0 and not self.uploader and newest is not None and newest.resolve() == path.resolve():
                complete_publish(self.local_folder, path.name, self.num_to_keep)  # on a store, the uploader prunes

    def publish_pending(self) -> None:
        """Wait for the checkpoint being written, publish it and fire its checkpoint event."""
        if self._pending is None:
            return
        pending, event = self._pending
        self._pending = None
        self.state.last_checkpoint_path = str(pending.finish())
        if self.uploader is not None:
            self.uploader.submit(pending.final_dir, pending.tmp_dir)
        self.engine.run_event(event)

    def wait_for_uploads(self) -> None:
        """Wait until every checkpoint is uploaded to the object store (nothing to wait for without one)."""
        if self.uploader is not None:
            with contextlib.suppress(CheckpointError):  # logged already; the error being raised matters more
                self.uploader.wait()

    def _start_uploads(self, store: ObjectStore) -> None:
        """Clean up after interrupted runs (on the store: unpublished folders; locally: checkpoints the store never
        published, which a resumed run saves again), and start the upload thread."""
        folders = store_checkpoints(store)
        published = published_checkpoints(store, folders)
        if self.state.rank == 0:
            remove_unpublished(store, folders)
        if distributed.get_local_rank() == 0:
            if self.local_folder.is_dir():
                remove_temporaries(self.local_folder)
            names = {name for name, _ in published}
            for folder in checkpoint_folders(self.local_folder):
                if folder.name not in names:
                    shutil.rmtree(folder, ignore_errors=True)
        known = [sequence for _, sequence in published if sequence != float("inf")]
        self._first_sequence = int(max(known, default=0)) + 1  # a new checkpoint is newer than all on the store
        state = self.state
        self.uploader = CheckpointUploader(
            store, self.local_folder, rank=state.rank, world_size=state.world_size, num_to_keep=self.num_to_keep
        )

    def settle_after_error(self) -> None:
        """After an exception, finish this rank's write; publish (and upload) it only when no other rank must agree."""
        pending = self._pending[0] if self._pending else None
        self._pending = None
        if self.state.world_size > 1:
            if pending is not None:
                pending.wait()  # peers may not reach a barrier: the folder stays temporary, the next save removes it
            return
        if pending is not None:
            self.state.last_checkpoint_path = str(pending.finish())
            if self.uploader is not None:
                self.uploader.submit(pending.final_dir, pending.tmp_dir)
        if self.uploader is not None:
            with contextlib.suppress(CheckpointError):  # logged already; the error being raised matters more
                self.uploader.wait()
