"""Which checkpoint to load: the one a save_folder published last, or the folder a path names, verified.

"Latest" is the checkpoint with the highest publish sequence in its manifest (written last of its
files), never the ``latest`` pointer file: a kill between a folder's rename and the pointer's update
leaves the pointer one behind, and nothing here reads it.
"""

from __future__ import annotations

from pathlib import Path

from foundry.checkpoint.integrity import checkpoint_folders, verify_checkpoint
from foundry.checkpoint.layout import CHECKPOINT_NAME, MANIFEST_FILE, META_FILE
from foundry.checkpoint.remote import fetch_from_url
from foundry.checkpoint.safe_reader import METADATA_FILE
from foundry.core.paths import check_storage_path, is_object_store_url
from foundry.errors import CheckpointError


def latest_checkpoint(save_folder: str | Path) -> Path | None:
    """The checkpoint ``save_folder`` published last, or None. Its files are not verified here."""
    folders = checkpoint_folders(save_folder)
    return folders[-1] if folders else None


def _composer_hint(path: str | Path) -> str:
    if not str(path).endswith((".pt", ".pt.tar")):
        return ""
    return (
        f" {Path(str(path)).name} looks like a Composer (LLM Foundry) checkpoint: convert it with `foundry convert "
        "from-composer <file> <out_folder>` (download it first from an object store) and set load_path to the folder."
    )


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder as given, or a save_folder's latest checkpoint; verified against its manifest.

    An object-store URL (``s3://...``) of either is downloaded into its local copy first (every rank must call
    this then); the local folder is returned.

    Raises:
        CheckpointError: nothing to load there; ``DamagedCheckpointError`` when a file differs from
            its checksum (an explicit path never falls back to an older checkpoint).
    """
    check_storage_path(str(path), "the checkpoint path", CheckpointError)
    if is_object_store_url(str(path)):
        if _composer_hint(path):
            raise CheckpointError(f"{path} is a file, not a checkpoint folder.{_composer_hint(path)}")
        path = fetch_from_url(str(path))
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"No checkpoint at {path}: nothing exists there. Check load_path: give a checkpoint folder "
            "(e.g. <save_folder>/ep0-ba100) or a save_folder to load its latest checkpoint."
        )
    if not path.is_dir():
        hint = _composer_hint(path)
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder (e.g. <save_folder>/ep0-ba100).{hint}")
    markers = (META_FILE, METADATA_FILE, MANIFEST_FILE)
    if not (CHECKPOINT_NAME.match(path.name) or any((path / marker).exists() for marker in markers)):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(
                f"{path} holds no checkpoint (no ep*-ba* folder). Point load_path at a checkpoint folder or at the "
                "save_folder of a run that saved one."
            )
        path = latest
    verify_checkpoint(path)
    return path
