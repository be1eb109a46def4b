"""Every random number generator a run draws from, as JSON, so a resumed run draws the same numbers.

Each rank has its own generators (dropout masks differ per rank), so each rank keeps its own
``rng-rank{r}.json``. Byte tensors (torch's generator states) are stored as base64.
"""

from __future__ import annotations

import base64
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foundry.checkpoint.layout import read_json_object
from foundry.errors import CheckpointError

log = logging.getLogger(__name__)


def rng_file_name(rank: int) -> str:
    return f"rng-rank{rank}.json"


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when CUDA is in use) every CUDA device's generator state."""
    version, mt_words, gauss_next = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt_words), gauss_next],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_cached_gaussian)],
        "torch": _encode(torch.get_rng_state()),
        "cuda": [],
    }
    # Asking an unused CUDA for its state would initialise it; a CPU run has nothing to keep there.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode(device_state) for device_state in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned; CUDA states go to as many devices as both sides have."""
    version, mt_words, gauss_next = state["python"]
    random.setstate((version, tuple(mt_words), gauss_next))
    np_name, np_keys, np_pos, np_has_gauss, np_cached_gaussian = state["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_cached_gaussian))
    torch.set_rng_state(_decode(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        for device_index, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_decode(device_state), device_index)


def rng_file_for_rank(folder: Path, rank: int) -> Path:
    """This rank's RNG file; after a world-size change a rank the save did not have falls back to rank 0's."""
    path = folder / rng_file_name(rank)
    if path.exists():
        return path
    fallback = folder / rng_file_name(0)
    if not fallback.exists():
        raise CheckpointError(
            f"Checkpoint {folder} has no {path.name} (nor {fallback.name}): the checkpoint is incomplete. "
            "Load an earlier checkpoint, or pass load_weights_only=True to take only the model."
        )
    log.warning(
        "Checkpoint %s was saved by fewer ranks: rank %d has no %s and uses %s, so its random numbers "
        "will not continue exactly.",
        folder,
        rank,
        path.name,
        fallback.name,
    )
    return fallback


def load_rng_file(path: Path) -> None:
    try:
        set_rng_state(read_json_object(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"Cannot read the random-generator state in {path} ({exc}). The file is damaged; "
            "load another checkpoint or pass load_weights_only=True."
        ) from exc


def _encode(byte_tensor: torch.Tensor) -> str:
    return base64.b64encode(byte_tensor.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
