from __future__ import annotations

import torch

from foundry.data import collate_lm_samples


def test_unpadded_batch_is_plain_input_ids() -> None:
    samples = [{"input_ids": torch.arange(4), "attention_mask": torch.ones(4, dtype=torch.int64)}] * 2
    batch = collate_lm_samples(samples)
    assert set(batch) == {"input_ids"}
    assert batch["input_ids"].shape == (2, 4)


def test_padded_batch_gets_labels_ignored_at_padding() -> None:
    mask = torch.tensor([1, 1, 0, 0])
    batch = collate_lm_samples([{"input_ids": torch.tensor([5, 6, 0, 0]), "attention_mask": mask}])
    assert batch["labels"].tolist() == [[5, 6, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0]]
