"""The run's checkpoint section at work: where its checkpoints go, when they are written, where it starts from.

A save_folder on an object store is written in its local copy, and each checkpoint published there is
then uploaded in the background (``foundry.checkpoint.uploader``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from foundry import distributed
from foundry.checkpoint.config import CheckpointConfig
from foundry.checkpoint.find import latest_checkpoint
from foundry.checkpoint.load import resume_or_load
from foundry.checkpoint.lock import SaveFolderLock, lock_save_folder
from foundry.checkpoint.object_store import ObjectStore, object_store
from foundry.checkpoint.owner import check_save_folder
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
from foundry.core import Engine, Event, Interval
from foundry.core.paths import is_object_store_url, local_copy, public_location
from foundry.core.time import Timestamp
from foundry.distributed.env import all_gather_object
from foundry.errors import CheckpointError, CheckpointUploadError, ConfigError

log = logging.getLogger(__name__)


class Checkpointer:
    """Owns a run's ``CheckpointConfig``: checks it, resumes the run, and writes its checkpoints at ``save_interval``.

    Built from the section and the run's name before the model exists (``foundry train`` builds it first,
    so a refused save_folder fails before any model is built): ``{run_name}`` is filled into save_folder
    and load_path here, and the save_folder is checked here, once (writable, and holding no other run's
    checkpoints: ``foundry.checkpoint.owner``). ``start`` joins the run's engine and locks the save_folder
    for this run until ``release_lock`` (``foundry.checkpoint.lock``); ``resume`` loads what the run starts
    from, and refuses a checkpoint of this save_folder recorded with other trained settings unless
    ``autoresume_accept_changes`` (``foundry.checkpoint.resume_check``); ``after_batch`` / ``after_epoch`` /
    ``at_fit_end`` save when due. Without a save_folder nothing is written.

    A save_folder on an object store (``s3://...``) is written in its local copy and uploaded, each failed
    upload retried ``save_upload_retries`` times; after ``save_max_failed_uploads`` failed checkpoints in a
    row a save raises ``CheckpointUploadError`` (the run stops rather than train on with nothing durable).
    With ``save_async`` checkpoints are written in a background thread (over a gloo group of its own) and
    published at the next save, at fit's end, or after an error.
    """

    def __init__(self, config: CheckpointConfig, run_name: str) -> None:
        self.config = config.for_run(run_name)
        self.save_folder = self.config.save_folder or None
        self.load_path = self.config.load_path
        on_store = is_object_store_url(self.save_folder)
        self.local_folder = Path(local_copy(self.save_folder) if on_store else self.save_folder or ".")
        self.save_interval = Interval(self.config.save_interval)
        if self.save_folder:
            check_save_folder(self.config, run_name)
        self._check_load_path()
        self.uploader: CheckpointUploader | None = None
        self._first_sequence = 1
        self._async_group = None
        self.lock: SaveFolderLock | None = None
        self._pending: tuple[PendingCheckpoint, Event] | None = None  # and the event to fire when published
        self.last_save_batch: int | None = None

    def _check_load_path(self) -> None:
        """A local load_path must exist, unless autoresume finds a checkpoint in save_folder first."""
        load_path = self.load_path
        if not load_path or is_object_store_url(load_path) or Path(load_path).exists():
            return
        resumable = is_object_store_url(self.save_folder) or latest_checkpoint(self.local_folder) is not None
        if self.config.autoresume and self.save_folder and resumable:
            return
        raise ConfigError(
            f"'load_path' is '{load_path}', where nothing exists. Give a checkpoint folder (e.g. "
            "<save_folder>/ep0-ba100) or the save_folder of a run that saved one, or remove load_path to start from "
            "fresh weights."
        )

    def start(self, engine: Engine, run_config: dict | None) -> None:
        """Join the run of ``engine`` (whose state, callbacks and algorithms are saved, with ``run_config``, the
        resolved YAML): delete what interrupted saves left (``.tmp-*``; on a store, unpublished folders), upload
        local checkpoints the store has not published, and start the upload thread. Every rank calls it: the
        save_folder is locked for this run (one live run per folder), or every rank raises."""
        self.engine, self.state, self.run_config = engine, engine.state, run_config
        if not self.save_folder:
            return
        self.lock = lock_save_folder(self.local_folder, self.state.run_name, self.state.rank)
        if self.state.rank == 0 and self.local_folder.is_dir():
            remove_temporaries(self.local_folder)
        if is_object_store_url(self.save_folder):
            store = object_store(self.save_folder)
            store.upload_retries = self.config.save_upload_retries
            store.upload_backoff_s = self.config.save_upload_backoff_s
            self._start_uploads(store)
        if self.config.save_async:
            self._async_group = distributed.new_gloo_group()

    def resume(self) -> Path | None:
        """Load what the run starts from (autoresume's newest intact checkpoint, else load_path); its folder or None."""
        config = self.config
        path = resume_or_load(
            self.state,
            save_folder=self.save_folder,
            load_path=self.load_path,
            weights_only=config.load_weights_only,
            autoresume=config.autoresume,
            callbacks=self.engine.callbacks,
            algorithms=self.engine.algorithms,
        )
        if path is not None:
            self._loaded(path)
            self.engine.logger.log_text(
                f"Loaded checkpoint {public_location(path)} at batch {self.state.timestamp.batch}."
            )
        return path

    def after_batch(self, since: Timestamp) -> None:
        """Save if the batch that began at ``since`` crossed a multiple of save_interval."""
        if self.save_interval.due(self.state, since=since):
            self.save(Event.BATCH_CHECKPOINT)

    def after_epoch(self, since: Timestamp) -> None:
        """Save if save_interval is in epochs and the epoch that ended after ``since`` crossed one of its multiples."""
        if self.save_interval.due(self.state, epoch_end=True, since=since):
            self.save(Event.EPOCH_CHECKPOINT)

    def at_fit_end(self) -> None:
        """Checkpoint the final model unless the last batch already did; wait until every checkpoint is published
        (and uploaded)."""
        if self.save_folder and self.last_save_batch != self.state.timestamp.batch:
            self.save(Event.BATCH_CHECKPOINT)
        self.publish_pending()
        self.wait_for_uploads()

    def save(self, event: Event) -> None:
        """Start a checkpoint of the current state; ``event`` fires once it is published."""
        if not self.save_folder:
            return
        self.publish_pending()  # one write at a time
        if self.uploader is not None:
            self.uploader.wait()  # one upload at a time, and every rank counts the same failures
        store_down = self.uploader is not None and self.uploader.failed_in_a_row >= self.config.save_max_failed_uploads
        self.engine.logger.flush()  # the metrics of the batches this checkpoint holds reach the loggers first
        self.engine.run_event(Event.BEFORE_CHECKPOINT)
        pending = start_checkpoint(
            self.local_folder,
            self.state,
            callbacks=self.engine.callbacks,
            algorithms=self.engine.algorithms,
            config=self.run_config,
            overwrite=self.config.save_overwrite,
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
                f"The last {self.config.save_max_failed_uploads} checkpoints in a row could not be uploaded, so the "
                "run stops rather than train on with nothing durable (save_max_failed_uploads)."
            )

    @property
    def num_to_keep(self) -> int:
        return self.config.save_num_checkpoints_to_keep

    def _loaded(self, path: Path) -> None:
        """The run resumed from checkpoint ``path``: if it is one of ours, fit's end need not save that batch again.

        If it is our newest, rank 0 also completes its publish (``latest``, retention), which a kill right
        after its rename would have left undone.
        """
        if self.save_folder and path.parent.resolve() == self.local_folder.resolve():
            # A relaunch trains what its checkpoint was trained with (or says so with autoresume_accept_changes).
            check_resumed_config(path, self.run_config, self.config.autoresume_accept_changes)
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
