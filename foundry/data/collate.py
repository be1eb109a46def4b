"""Stack per-sample tensors into the batch format every foundry model reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from foundry.batches import IGNORE_INDEX


def collate_lm_samples(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into ``{"input_ids": (batch, seq), ...}``.

    ``attention_mask`` and ``labels`` (-100 at padding) are kept only when the batch has padding:
    a batch of full-length samples is plain ``input_ids``, which lets models skip masking work.
    """
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
    attention_mask = batch.get("attention_mask")
    if attention_mask is None:
        return batch
    if bool(attention_mask.all()):
        del batch["attention_mask"]
        return batch
    if "labels" not in batch:
        batch["labels"] = batch["input_ids"].masked_fill(attention_mask == 0, IGNORE_INDEX)
    return batch
