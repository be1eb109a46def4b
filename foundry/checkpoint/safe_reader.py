"""Read torch.distributed.checkpoint folders without unpickling arbitrary objects.

DCP stores two pickles: the ``.metadata`` file (``FileSystemReader.read_metadata`` calls plain
``pickle.load``) and each non-tensor value (``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)``). A checkpoint downloaded from elsewhere could run code through
either. ``SafeFileSystemReader`` unpickles the metadata with an allowlist of DCP's own data classes;
``SafeLoadPlanner`` reads values with ``weights_only=True``; the reader refuses any other planner.
Tensor payloads are already read with ``weights_only=True`` by DCP.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from foundry.errors import CheckpointError

METADATA_FILE = ".metadata"

# Every class DCP's Metadata needs (besides those defined in metadata.py itself, allowed below).
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # rebuilds torch.strided from its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    # StorageMeta.checkpoint_id is the path the checkpoint was written to.
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP metadata classes, torch sizes/dtypes and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        if module == "torch" and "." not in name:
            found = getattr(torch, name, None)
            if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def load_metadata_safely(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, refusing any class outside the allowlist."""
    try:
        with open(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"Checkpoint {path.parent} has no {METADATA_FILE} file: the checkpoint is incomplete "
            "(its save was interrupted). Load an earlier checkpoint."
        ) from exc
    except Exception as exc:
        raise CheckpointError(
            f"Refusing to load {path}: it is not plain DCP metadata ({exc}). The file is damaged or was "
            "tampered with; load only checkpoints you trust, or an earlier one."
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; the file is damaged.")
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is a page long; the line naming the refused GLOBAL is the one that matters.
            lines = str(exc).splitlines()
            detail = next((line.strip() for line in lines if "GLOBAL" in line), lines[0])
            raise CheckpointError(
                f"Refusing to load checkpoint value '{read_item.dest_index.fqn}': it holds objects other "
                f"than tensors and plain Python values ({detail}). Load only checkpoints you trust."
            ) from exc
        # The bytes are now known to hold only allowed types, so the parent's unrestricted load of
        # these same in-memory bytes is safe; reusing it keeps DCP's own placement logic.
        value.seek(0)
        super().load_bytes(read_item, value)


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled through an allowlist (and read once)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    # No **kwargs: DCP then never retries with a rank-local metadata file after we refuse one.
    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = load_metadata_safely(Path(self.path) / METADATA_FILE)
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError(
                f"SafeFileSystemReader({self.path}) needs planner=SafeLoadPlanner(); DCP's default planner "
                "unpickles non-tensor values without restriction."
            )
        return super().read_data(plan, planner)
