"""Named instants of a save and its publishing, where fault-injection runs kill the process.

``benchmarks/fault_injection.py`` (and the quick tests of it) set ``FOUNDRY_KILL_AT`` to
``<point>[@<n>][:rank<r>]``: the process (only rank ``r``'s when given) sends itself SIGKILL the
``n``-th time (default: the first) it reaches ``<point>``. Unset, a point costs one environment lookup.
``FOUNDRY_KILL_WITH`` sends another signal instead: ``SIGTERM`` (to the process itself) or
``SIGTERM:parent`` (to the process that started it: ``foundry train --nproc``'s launcher), which is
how tests preempt a run at a known batch. Several points, comma-separated, each send it once: a
scheduler's second SIGTERM after the run stopped for the first is ``train.batch_end@2,train.fit_returned``.

The points, in the order a save reaches them (``foundry.checkpoint.save``)::

    save.started            temporary folder chosen, nothing written yet
    save.metadata_written   rng-rank<r>.json (and meta.json) written, tensors not yet
    save.tensors_written    the tensors written (in the background thread with save_async)
    save.hashed             this rank's files hashed
    publish.manifest_written  manifest.json written into the temporary folder
    publish.renamed         the folder renamed into place, the `latest` pointer not yet updated
    publish.latest_written  `latest` updated, older checkpoints not yet pruned
    prune.renamed           an old checkpoint renamed to .tmp-delete-*, not yet deleted

In ``foundry train``: once the process group is joined (nothing built yet), at the end of each training batch,
before the ranks agree whether to stop (``foundry.checkpoint.preemption``), and once ``fit()`` has returned (its
signal handlers given back)::

    train.started
    train.batch_end
    train.fit_returned

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
SIGNAL_VARIABLE = "FOUNDRY_KILL_WITH"
_reached: Counter[str] = Counter()


def kill_point(name: str) -> None:
    """SIGKILL this process here (or send ``FOUNDRY_KILL_WITH``) if ``FOUNDRY_KILL_AT`` names this point, this
    visit and this rank."""
    targets = os.environ.get(ENV_VARIABLE)
    if not targets:
        return
    for target in targets.split(","):
        point, _, rank = target.partition(":rank")
        point, _, visit = point.partition("@")
        if point != name or (rank and rank != os.environ.get("RANK", "0")):
            continue
        _reached[name] += 1
        if _reached[name] == int(visit or 1):
            signal_name, _, receiver = os.environ.get(SIGNAL_VARIABLE, "SIGKILL").partition(":")
            os.kill(os.getppid() if receiver == "parent" else os.getpid(), signal.Signals[signal_name])
        return


def reset() -> None:
    """Forget the visits counted so far (a test that trains several times in one process)."""
    _reached.clear()
