"""What a causal language model predicts at each position: the next token, or nothing (``IGNORE_INDEX``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

IGNORE_INDEX = -100  # a label position that adds no loss (prompts, padding, the last position)
SHIFTED_LABELS_KEY = "shifted_labels"  # (batch, seq) targets already shifted, as a split sequence carries them


def shifted_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """Position t's target is token t+1; the last position (and any -100 label) is ignored.

    A batch that carries ``shifted_labels`` (a piece of a longer sequence, whose last token's target
    lies in the next piece) has its targets already: they are returned as they are.
    """
    if SHIFTED_LABELS_KEY in batch:
        return batch[SHIFTED_LABELS_KEY]
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    targets = torch.roll(labels, shifts=-1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    return targets
