"""The batch's logged loss, token accuracy and loss terms are summed over ranks in one all-reduce, with the values
that one all-reduce each gives."""

from __future__ import annotations

from typing import Any

import torch

import foundry.distributed
from distributed.jobs import build_trainer
from foundry.core import LoggerDestination
from foundry.distributed import all_reduce_sum, all_reduce_sums, get_rank

MOE = {"ffn_config": {"ffn_type": "mb_dmoe", "moe_num_experts": 4, "moe_top_k": 2, "moe_zloss_weight": 0.01}}


class TrainMetrics(LoggerDestination):
    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.by_step.setdefault(step, {}).update(metrics)


def _one_all_reduce_each(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    return [all_reduce_sum(tensor.clone(), group) for tensor in tensors]


def logged_train_metrics(folder: str, one_all_reduce_each: bool) -> dict | None:
    """Rank 0's logged train metrics of an MoE (loss terms) trained 2 batches, less the timings."""
    patched = foundry.distributed.all_reduce_sums
    if one_all_reduce_each:
        foundry.distributed.all_reduce_sums = _one_all_reduce_each
    try:
        trainer = build_trainer(2, folder, model_keys=MOE)
        recorder = TrainMetrics()
        trainer.logger.destinations.append(recorder)
        trainer.fit()
    finally:
        foundry.distributed.all_reduce_sums = patched
    keep = ("loss/train/", "metrics/train/")
    return {
        step: {key: value for key, value in metrics.items() if key.startswith(keep)}
        for step, metrics in recorder.by_step.items()
    } if get_rank() == 0 else None  # fmt: skip


def test_one_all_reduce_logs_the_values_of_one_all_reduce_each(ranks, tmp_path):
    together = ranks.run(2, logged_train_metrics, str(tmp_path / "together"), False)[0]
    apart = ranks.run(2, logged_train_metrics, str(tmp_path / "apart"), True)[0]
    assert {"loss/train/total", "loss/train/router_z", "metrics/train/TokenAccuracy"} <= set(together[1])
    assert together == apart


def sums_both_ways() -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank = get_rank()
    generator = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randn((), generator=generator) * 10 ** (3 * rank),  # a float32 loss, ranks apart in magnitude
        torch.tensor(2**24 + 1 + rank * 2**40),  # an int64 count float32 could not hold
        torch.randn(3, generator=generator),
    ]
    return list(zip(all_reduce_sums(tensors), _one_all_reduce_each(tensors)))


def test_summed_tensors_keep_their_dtype_shape_and_value(ranks):
    for together, apart in ranks.run(2, sums_both_ways)[0]:
        assert together.dtype == apart.dtype and torch.equal(together, apart)
