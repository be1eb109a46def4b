"""Reference log-probabilities computed once, as a run starts, and stored beside the data (``reference: precomputed``).

``<data folder>/reference-logps-<key>.pt`` holds a (pairs, 2) float32 table: each pair's chosen and rejected
summed log-probability under the weights the run starts from. Its key hashes the pairs' tokens, the model
section and ``load_path``, so a run from the same data and starting checkpoint reuses the file, and a run that
resumes (its model has moved since) reads it. A step then costs one forward and one backward, and no reference
weights are held. A checkpoint replaced at the same ``load_path`` needs the file deleted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry.core.precision import autocast
from foundry.data.preference import PreferenceDataLoader, collate_pairs
from foundry.distributed.env import all_gather_object, barrier, get_rank
from foundry.errors import ConfigError, TrainingError
from foundry.preference.logps import model_sequence_logps


def reference_table(model: nn.Module, state: Any, load_path: str | None) -> torch.Tensor:
    """The (pairs, 2) table for ``state.train_dataloader``'s pairs: read, or computed with ``model`` and written
    when the run starts (every rank calls this)."""
    loader = state.train_dataloader
    path = cache_path(model, loader, load_path)
    if path.is_file():
        return torch.load(path, weights_only=True)
    if state.timestamp.batch > 0:
        raise TrainingError(
            f"This run resumes at batch {state.timestamp.batch} with 'preference.reference: precomputed', but the "
            f"reference log-probabilities computed when it started ({path}) are gone; its model has moved since, "
            "so they cannot be recomputed. Restore the file, or start the run again."
        )
    was_training = model.training
    model.eval()  # scored as the frozen copy scores: no dropout, and not through a compiled training forward
    try:
        with torch.no_grad(), autocast(state.precision, state.device):
            table = _compute(model, loader, state.device)
    finally:
        model.train(was_training)
    if get_rank() == 0:
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(table, partial)
        partial.replace(path)  # readers never see a half-written table
    barrier()
    return table


def cache_path(model: nn.Module, loader: Any, load_path: str | None) -> Path:
    """Where the table of ``loader``'s pairs under the model's starting weights lives, beside the data."""
    if not isinstance(loader, PreferenceDataLoader) or loader.data_folder is None:
        raise ConfigError(
            "'preference.reference: precomputed' stores the reference log-probabilities beside the data, so it needs "
            "a 'preference' train_loader reading a local .jsonl file, folder or MDS 'local' folder; use reference: "
            "copy (or adapters_off for LoRA) otherwise."
        )
    digest = hashlib.sha256()
    for pair in loader.pairs:
        for tokens in (pair.prompt, pair.chosen, pair.rejected):
            digest.update(tokens.tobytes() + b"|")
    section = model.model_section() if hasattr(model, "model_section") else None
    digest.update(json.dumps([section, load_path], sort_keys=True, default=str).encode())
    return loader.data_folder / f"reference-logps-{digest.hexdigest()[:16]}.pt"


def _compute(model: nn.Module, loader: PreferenceDataLoader, device: torch.device) -> torch.Tensor:
    """Each rank scores every world_size-th pair, one pair per row, in as many forwards as every other rank (a
    sharded model's ranks run each forward together); the shares are then gathered."""
    pairs = loader.pairs
    share = list(range(loader.rank, len(pairs), loader.world_size))
    largest_share = math.ceil(len(pairs) / loader.world_size)
    forwards = math.ceil(largest_share / loader.device_batch_size)
    scores: dict[int, tuple[float, float]] = {}
    for step in range(forwards):
        indices = share[step * loader.device_batch_size : (step + 1) * loader.device_batch_size]
        batch = collate_pairs([[pairs[index]] for index in indices], loader.pad_token_id, packed=False)
        rows = {key: torch.cat([value[:, 0], value[:, 1]]).to(device) for key, value in batch.items()}
        logps, _ = model_sequence_logps(model, {"input_ids": rows["input_ids"]}, rows["labels"])
        chosen, rejected = logps[:, 0].float().chunk(2)
        scores.update(zip(indices, zip(chosen.tolist(), rejected.tolist())))
    for rank_scores in all_gather_object(scores):
        scores.update(rank_scores)
    return torch.tensor([scores[index] for index in range(len(pairs))], dtype=torch.float32)
