"""Named instants of a save and its publishing, where fault-injection runs kill the process.

``benchmarks/fault_injection.py`` (and the quick tests of it) set ``FOUNDRY_KILL_AT`` to
``<point>[@<n>][:rank<r>]``: the process (only rank ``r``'s when given) sends itself SIGKILL the
``n``-th time (default: the first) it reaches ``<point>``. Unset, a point costs one environment lookup.

The points, in the order a save reaches them (``foundry.checkpoint.save``)::

    save.started            temporary folder chosen, nothing written yet
    save.metadata_written   rng-rank<r>.json (and meta.json) written, tensors not yet
    save.tensors_written    the tensors written (in the background thread with save_async)
    save.hashed             this rank's files hashed
    publish.manifest_written  manifest.json written into the temporary folder
    publish.renamed         the folder renamed into place, the `latest` pointer not yet updated
    publish.latest_written  `latest` updated, older checkpoints not yet pruned
    prune.renamed           an old checkpoint renamed to .tmp-delete-*, not yet deleted

With an object-store save_folder, in the upload thread (``foundry.checkpoint.remote``)::

    upload.file_uploaded    one more file of a checkpoint uploaded (not yet published on the store)
    upload.files_uploaded   every rank's files uploaded, the manifest not yet
    upload.published        the manifest uploaded (the checkpoint is published), `latest` not yet
    prune.unpublished       an old checkpoint's manifest deleted on the store, its other files not yet
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV_VARIABLE = "FOUNDRY_KILL_AT"
_reached: Counter[str] = Counter()


def kill_point(name: str) -> None:
    """SIGKILL this process here if ``FOUNDRY_KILL_AT`` names this point, this visit and this rank."""
    target = os.environ.get(ENV_VARIABLE)
    if not target:
        return
    point, _, rank = target.partition(":rank")
    point, _, visit = point.partition("@")
    if point != name or (rank and rank != os.environ.get("RANK", "0")):
        return
    _reached[name] += 1
    if _reached[name] == int(visit or 1):
        os.kill(os.getpid(), signal.SIGKILL)
