"""The Trainer's checkpoint writes: one at a time, each published (and its event fired) once complete.

A save_folder on an object store is written in its local copy, and each checkpoint published there is
then uploaded in the background (``foundry.checkpoint.uploader``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from foundry import distributed
from foundry.checkpoint.find import latest_checkpoint
from foundry.checkpoint.lock import SaveFolderLock, lock_save_folder
from foundry.checkpoint.object_store import ObjectStore, object_store
from foundry.checkpoint.owner import check_save_folder_owner
from foundry.checkpoint.remote import (
    prune_store,
    publish_local_copies,
    published_checkpoints,
    remove_unpublished,
    store_checkpoints,
)
from foundry.checkpoint.resume_check import check_resumed_config
from foundry.checkpoint.save import PendingCheckpoint, complete_publish, remove_temporaries, start_checkpoint
from foundry.checkpoint.uploader import CheckpointUploader
from foundry.core import Engine, Event
from foundry.core.paths import check_writable_folder, is_object_store_url, local_copy
from foundry.distributed.env import all_gather_object
from foundry.errors import CheckpointError, CheckpointUploadError

log = logging.getLogger(__name__)


class CheckpointSaver:
    """Writes the run's checkpoints into ``save_folder`` (nothing without one) when the Trainer asks.

    Args:
        engine: fires BEFORE_CHECKPOINT, and the checkpoint event once the checkpoint is published;
            its state, callbacks and algorithms are what is saved.
        save_folder: where checkpoints go (checked to be writable now, and locked for this run until
            ``release_lock``: ``foundry.checkpoint.lock``); None saves nothing. What
            interrupted saves left there (``.tmp-*``) is deleted now. An object-store URL (``s3://...``):
            checkpoints are written in its local copy and uploaded; what interrupted uploads left on the
            store is deleted now, and local checkpoints the store has not published are uploaded now.
        overwrite / num_to_keep: ``start_checkpoint``'s options.
        save_async: write in a background thread (over a gloo group of its own) while training goes on;
            the checkpoint is published at the next save, at fit's end, or after an error.
        config: the resolved YAML, stored in each checkpoint.
        upload_retries / upload_backoff_s: an object-store save_folder retries each failed upload this many
            times, waiting ``upload_backoff_s`` seconds, then twice as long each time.
        autoresume / load_path / named_run: whether the run resumes, what it loads, and whether its name was
            given: a save_folder holding another run's checkpoints is refused (``foundry.checkpoint.owner``).
        accept_config_changes: resume from a checkpoint of this save_folder even though ``config`` trains otherwise
            than the one it records (``foundry.checkpoint.resume_check``).
        max_failed_uploads: a save raises ``CheckpointUploadError`` once this many checkpoints in a row failed to
            upload (the run stops rather than train on with nothing durable); ``wait_for_uploads`` raises it for
            any that failed.
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
        upload_retries: int,
        upload_backoff_s: float,
        max_failed_uploads: int,
        autoresume: bool,
        load_path: str | None,
        named_run: bool,
        accept_config_changes: bool = False,
    ) -> None:
        self.engine, self.state = engine, engine.state
        self.save_folder = save_folder
        self.local_folder = Path(local_copy(save_folder) if is_object_store_url(save_folder) else save_folder or ".")
        self.overwrite, self.num_to_keep, self.config = overwrite, num_to_keep, config
        self.accept_config_changes = accept_config_changes
        self.uploader: CheckpointUploader | None = None
        self._first_sequence = 1
        self.max_failed_uploads = max_failed_uploads
        self.lock: SaveFolderLock | None = None
        if save_folder:
            check_writable_folder(self.local_folder, "save_folder")  # on every rank: all of them stop, or none
            self.lock = lock_save_folder(self.local_folder, self.state.run_name, self.state.rank)  # one live run
            check_save_folder_owner(
                save_folder,
                self.state.run_name,
                named=named_run,
                autoresume=autoresume,
                overwrite=overwrite,
                load_path=load_path,
            )
            if self.state.rank == 0 and self.local_folder.is_dir():
                remove_temporaries(self.local_folder)
            if is_object_store_url(save_folder):
                store = object_store(save_folder)
                store.upload_retries, store.upload_backoff_s = upload_retries, upload_backoff_s
                self._start_uploads(store)
        self._async_group = distributed.new_gloo_group() if save_async and save_folder else None
        self._pending: tuple[PendingCheckpoint, Event] | None = None  # and the event to fire when published
        self.last_save_batch: int | None = None

    def save(self, event: Event) -> None:
        """Start a checkpoint of the current state; ``event`` fires once it is published."""
        if not self.save_folder:
            return
        self.publish_pending()  # one write at a time
        if self.uploader is not None:
            self.uploader.wait()  # one upload at a time, and every rank counts the same failures
        store_down = self.uploader is not None and self.uploader.failed_in_a_row >= self.max_failed_uploads
        self.engine.logger.flush()  # the metrics of the batches this checkpoint holds reach the loggers first
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
        if self._async_group is None or store_down:
            self.publish_pending(upload=not store_down)  # kept in the local copy, uploaded by the relaunch
        if store_down:
            self.uploader.failed.append(pending.final_dir.name)  # not uploaded either
            raise self._upload_error(
                f"The last {self.max_failed_uploads} checkpoints in a row could not be uploaded, so the run stops "
                "rather than train on with nothing durable (save_max_failed_uploads)."
            )

    def loaded(self, path: Path) -> None:
        """The run resumed from checkpoint ``path``: if it is one of ours, fit's end need not save that batch again.

        If it is our newest, rank 0 also completes its publish (``latest``, retention), which a kill right
        after its rename would have left undone.
        """
        if self.save_folder and path.parent.resolve() == self.local_folder.resolve():
            check_resumed_config(path, self.config, self.accept_config_changes)  # a relaunch trains the same way
            self.last_save_batch = self.state.timestamp.batch
            newest = latest_checkpoint(self.local_folder)
            if self.state.rank == 0 and not self.uploader and newest is not None and newest.resolve() == path.resolve():
                complete_publish(self.local_folder, path.name, self.num_to_keep)  # on a store, the uploader prunes

    def publish_pending(self, upload: bool = True) -> None:
        """Wait for the checkpoint being written, publish it (and upload it, unless not ``upload``) and fire its
        checkpoint event."""
        if self._pending is None:
            return
        pending, event = self._pending
        self._pending = None
        self.state.last_checkpoint_path = str(pending.finish())
        if self.uploader is not None and upload:
            self.uploader.submit(pending.final_dir, pending.tmp_dir)
        self.engine.run_event(event)

    def wait_for_uploads(self) -> None:
        """Wait until every checkpoint is uploaded to the object store (nothing to wait for without one); raise
        ``CheckpointUploadError`` naming those that could not be."""
        if self.uploader is None:
            return
        self.uploader.wait()
        if self.uploader.failed:
            raise self._upload_error("The run finished, but not every checkpoint reached the store.")

    def _upload_error(self, what: str) -> CheckpointUploadError:
        failure = self.uploader.last_failure
        return CheckpointUploadError(
            f"{what} Not on {self.save_folder}: {', '.join(self.uploader.failed)} ({failure}). "
            f"They are kept in {self.local_folder}: relaunch the same command with autoresume: true once the store "
            "is reachable, and it uploads them and resumes from the newest (only this machine's disk holds them)."
        )

    def _start_uploads(self, store: ObjectStore) -> None:
        """Clean up after interrupted runs (on the store: unpublished folders), upload the checkpoints an earlier run
        kept in the local copy because it could not upload them, and start the upload thread."""
        folders = store_checkpoints(store)
        published = published_checkpoints(store, folders)
        if distributed.get_local_rank() == 0 and self.local_folder.is_dir():
            remove_temporaries(self.local_folder)
        problem = None
        if self.state.rank == 0:
            remove_unpublished(store, folders)
            try:
                published = self._publish_local_copies(store, published)
            except CheckpointError as error:
                problem = str(error)
        problem, published = all_gather_object((problem, published))[0]  # rank 0's
        if problem is not None:
            raise CheckpointUploadError(
                f"{problem} The checkpoints an earlier run could not upload stay in {self.local_folder}: relaunch "
                "once the store is reachable."
            )
        known = [sequence for _, sequence in published if sequence != float("inf")]
        self._first_sequence = int(max(known, default=0)) + 1  # a new checkpoint is newer than all on the store
        state = self.state
        self.uploader = CheckpointUploader(
            store, self.local_folder, rank=state.rank, world_size=state.world_size, num_to_keep=self.num_to_keep
        )

    def _publish_local_copies(self, store: ObjectStore, published: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """Upload the local copies the store lacks, then keep ``num_to_keep`` on both; what the store publishes."""
        if not publish_local_copies(store, self.local_folder, published):
            return published
        published = published_checkpoints(store)
        for name in prune_store(store, self.num_to_keep, keep_name=published[-1][0]):
            shutil.rmtree(self.local_folder / name, ignore_errors=True)
        return published_checkpoints(store)

    def release_lock(self) -> None:
        """Give the save_folder back to other runs (``foundry.checkpoint.lock``); fit's end does."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

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
            self.uploader.wait()  # a failed upload is logged: the error being raised matters more
            if self.uploader.failed:
                log.error(
                    "Not on %s: %s, kept in %s.", self.save_folder, ", ".join(self.uploader.failed), self.local_folder
                )
