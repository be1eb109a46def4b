"""Clipping by global norm on 2 sharded ranks clips exactly as one process does."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import build_trainer, summary
from foundry.algorithms import GradientClipping

NUM_BATCHES = 3
THRESHOLD = 0.05  # well below the tiny model's gradient norms (about 1), so every step clips


def clipped_run(folder: str, fsdp_config: dict | None) -> dict | None:
    clipping = GradientClipping(clipping_type="norm", clipping_threshold=THRESHOLD)
    norms = []

    class RecordNorm(GradientClipping):  # runs right after the clipping: the norm it measured
        def apply(self, event, state, logger) -> None:
            assert type(state.grad_norm) is torch.Tensor  # a plain (replicated) tensor, not a DTensor shard
            norms.append(float(state.grad_norm))

    trainer = build_trainer(NUM_BATCHES, folder, fsdp_config, algorithms=[clipping, RecordNorm()])
    trainer.fit()
    result = summary(trainer)
    return None if result is None else {**result, "norms": norms}


def test_clipped_norm_on_two_ranks_equals_one_rank(ranks, tmp_path):
    one = ranks.run(1, clipped_run, str(tmp_path / "one"), None)[0]
    two = ranks.run(2, clipped_run, str(tmp_path / "two"), {"sharding_strategy": "FULL_SHARD"})[0]
    assert min(one["norms"]) > THRESHOLD
    assert two["norms"] == pytest.approx(one["norms"], rel=1e-5)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
