"""One file out of a sharded checkpoint: every tensor whole, on the CPU, whatever world size wrote it.

``foundry convert consolidate CKPT OUT`` writes the model's weights as safetensors (keyed by
parameter name, as the model's ``state_dict``); with ``--with-optimizer`` a ``torch.save`` file of
``{"model": ..., "optim": ...}`` (the optimizer state keyed by parameter name, as DCP stores it).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from foundry.checkpoint.find import resolve_checkpoint_path
from foundry.checkpoint.layout import TMP_PREFIX, fsync_dir, root_cause, single_process_quiet
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from foundry.errors import CheckpointError


class _SafeWholeStateLoadPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Builds the state dict from the checkpoint's metadata (no model needed); values read safely."""


def read_checkpoint_tensors(path: str | Path) -> dict[str, Any]:
    """``{"model": {name: tensor}, "optim": {...}}`` of a checkpoint folder (or a save_folder's latest).

    The files are verified against the checkpoint's manifest first; a file that passes but cannot be
    read (a checkpoint written by something else, or crafted) is a ``CheckpointError`` too.
    """
    folder = resolve_checkpoint_path(path)
    state: dict[str, Any] = {}
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()  # a refused .metadata raises here, before DCP would log its traceback and fall back
    try:
        with single_process_quiet():
            _load_state_dict(state, storage_reader=reader, planner=_SafeWholeStateLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:
        cause = root_cause(exc)
        if isinstance(cause, CheckpointError):
            raise cause from exc
        raise CheckpointError(
            f"Cannot read the tensors of checkpoint {folder} ({type(cause).__name__}: {cause}). Its files are not "
            "what foundry wrote; consolidate another checkpoint."
        ) from exc
    if "model" not in state:
        raise CheckpointError(f"Checkpoint {folder} holds no model tensors; it was not written by foundry.")
    return state


def consolidate(path: str | Path, out_file: str | Path, with_optimizer: bool = False) -> Path:
    """Write checkpoint ``path``'s model (and, ``with_optimizer``, its optimizer state) to ``out_file``.

    The file appears complete or not at all (written beside it, then renamed).
    """
    out_file = Path(out_file)
    state = read_checkpoint_tensors(path)
    if with_optimizer and "optim" not in state:
        raise CheckpointError(f"Checkpoint {path} holds no optimizer state; drop --with-optimizer.")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = out_file.with_name(f"{TMP_PREFIX}{out_file.name}-{secrets.token_hex(4)}")
    try:
        if with_optimizer:
            torch.save({"model": state["model"], "optim": state["optim"]}, tmp_file)
        else:
            weights = {name: tensor.contiguous() for name, tensor in state["model"].items()}
            save_file(_untie(weights), str(tmp_file), metadata={"format": "pt"})
        os.replace(tmp_file, out_file)
    finally:
        tmp_file.unlink(missing_ok=True)
    fsync_dir(out_file.parent)
    return out_file


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): give each its own copy."""
    seen: set[int] = set()
    untied = {}
    for name, tensor in weights.items():
        pointer = tensor.untyped_storage().data_ptr()
        untied[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return untied


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a save_folder (its latest checkpoint)")
    parser.add_argument("out_file", help="the file to write (.safetensors; .pt with --with-optimizer)")
    parser.add_argument(
        "--with-optimizer", action="store_true", help="write a torch .pt of the model and optimizer state"
    )


def run_consolidate(args: argparse.Namespace) -> int:
    folder = resolve_checkpoint_path(args.checkpoint)
    out_file = consolidate(folder, args.out_file, with_optimizer=args.with_optimizer)
    what = "model and optimizer state" if args.with_optimizer else "model weights"
    print(f"foundry: wrote the {what} of {folder} to {out_file}")
    return 0
