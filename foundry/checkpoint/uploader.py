"""Uploading a run's checkpoints to its object-store save_folder in a background thread, while training goes on.

Each checkpoint is first published in the local copy (``foundry.checkpoint.save``), then handed to
``CheckpointUploader.submit``. Its thread, one per rank, uploads checkpoints in the order they were
published: every rank uploads the files it wrote, the ranks agree over a gloo group of their own that
all succeeded, and rank 0 uploads the manifest (publishing the checkpoint on the store), then prunes
the store and the local copy to ``num_to_keep``. A checkpoint whose upload fails (after the store's
retries) stays in the local copy and is named in ``failed``; every rank reaches the same verdict, so
the Trainer's ranks stop together (``foundry.checkpoint.saver``). See ``foundry.checkpoint.remote`` for
what a reader of the store trusts, and how the next run uploads what failed.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
from pathlib import Path

import torch.distributed as dist

from foundry import distributed
from foundry.checkpoint.layout import MANIFEST_FILE, owner_rank
from foundry.checkpoint.object_store import ObjectStore
from foundry.checkpoint.remote import prune_store, publish_on_store, upload_files
from foundry.errors import CheckpointError

log = logging.getLogger(__name__)


class CheckpointUploader:
    """Uploads checkpoints of ``local_folder`` to object-store folder ``store`` (see the module's docstring).

    Every rank creates one (it joins a gloo group when several ranks run) and submits the same checkpoints.
    """

    def __init__(self, store: ObjectStore, local_folder: Path, *, rank: int, world_size: int, num_to_keep: int) -> None:
        self.store, self.local_folder, self.rank, self.num_to_keep = store, local_folder, rank, num_to_keep
        self._group = distributed.new_gloo_group() if world_size > 1 else None
        self._queue: queue.Queue[tuple[Path, Path]] = queue.Queue()
        # Every rank's thread reaches the same verdict on each checkpoint (they gather their problems).
        self.failed: list[str] = []  # the checkpoints not published on the store, oldest first
        self.failed_in_a_row = 0  # checkpoints whose upload failed since the last one that succeeded
        self.last_failure: CheckpointError | None = None
        # A daemon: a process that stops (an error, a lost rank) does not wait for an upload that cannot finish.
        threading.Thread(target=self._work, name="foundry-checkpoint-upload", daemon=True).start()

    def submit(self, final_dir: Path, tmp_dir: Path) -> None:
        """Upload checkpoint ``final_dir``, just published locally; ``tmp_dir`` is where it was written (on a machine
        whose disk rank 0 does not share, this rank's files are still there)."""
        self._queue.put((final_dir, tmp_dir))

    def wait(self) -> None:
        """Wait until every submitted checkpoint is uploaded or failed (``failed`` names those that failed)."""
        self._queue.join()

    def _work(self) -> None:
        while True:
            final_dir, tmp_dir = self._queue.get()
            try:
                self._upload(final_dir, tmp_dir)
                self.failed_in_a_row = 0
            except Exception as error:  # never let the thread die silently: wait() would hang
                failure = error if isinstance(error, CheckpointError) else CheckpointError(str(error))
                log.error("Uploading checkpoint %s to %s failed: %s", final_dir.name, self.store.url, failure)
                self.failed.append(final_dir.name)
                self.failed_in_a_row += 1
                self.last_failure = failure
            finally:
                self._queue.task_done()

    def _upload(self, final_dir: Path, tmp_dir: Path) -> None:
        source = tmp_dir if tmp_dir.is_dir() else final_dir
        problem = None
        try:
            upload_files(self.store, source, final_dir.name, self._own_files(source))
        except CheckpointError as error:
            problem = str(error)
        problems = [found for found in self._gather(problem) if found]
        if source == tmp_dir and self.rank != 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # this machine's share, uploaded: rank 0 publishes
        if not problems and self.rank == 0:
            try:
                publish_on_store(self.store, final_dir)
            except CheckpointError as error:
                problem = str(error)
        if not problems:  # rank 0's verdict on publishing reaches every rank: they count failures alike
            problems = [found for found in self._gather(problem if self.rank == 0 else None) if found]
        if problems:
            raise CheckpointError(problems[0])
        if self.rank == 0:
            try:
                pruned = prune_store(self.store, self.num_to_keep, keep_name=final_dir.name)
            except CheckpointError as error:  # published all the same: the next one prunes again
                log.warning("Checkpoint %s is published, but pruning older ones failed: %s", final_dir.name, error)
                pruned = []
            for name in pruned:
                shutil.rmtree(self.local_folder / name, ignore_errors=True)

    def _own_files(self, source: Path) -> list[str]:
        """The files this rank uploads: those it wrote and, on rank 0, the shared ones; the manifest comes last."""
        names = sorted(path.name for path in source.iterdir() if path.is_file() and path.name != MANIFEST_FILE)
        owners = {self.rank, None} if self.rank == 0 else {self.rank}
        return [name for name in names if owner_rank(name) in owners]

    def _gather(self, value: str | None) -> list[str | None]:
        if self._group is None:
            return [value]
        gathered: list[str | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered
