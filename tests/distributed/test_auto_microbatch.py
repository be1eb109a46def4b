"""device_train_microbatch_size: auto picks the largest microbatch that fits on every rank, keeping the math."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyLM, token_batches

from distributed.jobs import build_trainer, summary
from foundry.core import LoggerDestination
from foundry.distributed import get_rank
from foundry.errors import TrainingError
from foundry.trainer import Trainer

NUM_BATCHES = 3


class OutOfMemoryAbove(TinyLM):
    """A TinyLM whose forward raises CUDA's out-of-memory error on microbatches of more than ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, batch: dict) -> torch.Tensor:
        if batch["input_ids"].shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        logits = super().forward(batch)
        self.logit_square = logits.detach().pow(2).mean()  # a logged part of the loss, as an MoE's router losses
        return logits

    def loss_terms(self) -> dict[str, torch.Tensor]:
        return {"logit_square": self.logit_square}


class TrainMetrics(LoggerDestination):
    """The metrics each batch logs, by step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.by_step.setdefault(step, {}).update(metrics)


def _fit_tiny(tmp_path, limit: int, microbatch_size: int | str, *loggers: LoggerDestination) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        model=OutOfMemoryAbove(limit),
        train_dataloader=token_batches(NUM_BATCHES, batch_size=8),
        max_duration=f"{NUM_BATCHES}ba",
        device_train_microbatch_size=microbatch_size,
        run_folder=str(tmp_path / str(microbatch_size)),
        log_to_console=False,
        loggers=list(loggers),
    )
    trainer.fit()
    return trainer


def test_auto_picks_the_largest_halved_size_that_fits_and_trains_as_that_fixed_size(tmp_path):
    auto = _fit_tiny(tmp_path, limit=3, microbatch_size="auto")
    assert auto.state.device_train_microbatch_size == 2  # 8 and 4 ran out of memory
    fixed = _fit_tiny(tmp_path, limit=3, microbatch_size=2)
    for name, weight in fixed.state.model.state_dict().items():
        assert torch.equal(auto.state.model.state_dict()[name], weight), name


def test_auto_logs_what_the_fixed_size_logs_leaving_out_the_trial_microbatches(tmp_path):
    auto, fixed = TrainMetrics(), TrainMetrics()
    _fit_tiny(tmp_path, 3, "auto", auto)
    _fit_tiny(tmp_path, 3, 2, fixed)
    keys = ("loss/train/total", "loss/train/logit_square", "metrics/train/TokenAccuracy")
    assert [[auto.by_step[step][key] for key in keys] for step in range(1, NUM_BATCHES + 1)] == [
        [fixed.by_step[step][key] for key in keys] for step in range(1, NUM_BATCHES + 1)
    ]


def test_auto_fails_clearly_when_one_sample_does_not_fit(tmp_path):
    with pytest.raises(TrainingError, match="even one sample per microbatch"):
        _fit_tiny(tmp_path, limit=0, microbatch_size="auto")


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def _rig_out_of_memory(trainer: Trainer, where: str, limit: int) -> None:
    """Rank 1 runs out of memory in the first block's attention (forward or backward) above ``limit`` samples."""

    def hook(module, args, output):
        if get_rank() != 1 or output.shape[0] <= limit:
            return output
        if where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return _RaiseInBackward.apply(output)

    trainer.state.model.transformer.blocks[0].attn.register_forward_hook(hook)


def train_with_out_of_memory(folder: str, where: str | None, microbatch_size: int | str) -> dict:
    """A 2-rank FULL_SHARD run; returns every rank's chosen size and rank 0's losses and weights."""
    trainer = build_trainer(NUM_BATCHES, folder, {}, device_train_microbatch_size=microbatch_size)
    if where is not None:
        _rig_out_of_memory(trainer, where, limit=1)
    trainer.fit()
    return {"microbatch_size": trainer.state.device_train_microbatch_size, "run": summary(trainer)}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_ranks_agree_when_only_one_runs_out_of_memory(ranks, where, tmp_path):
    auto = ranks.run(2, train_with_out_of_memory, str(tmp_path / "auto"), where, "auto")
    assert [rank["microbatch_size"] for rank in auto] == [1, 1]
    fixed = ranks.run(2, train_with_out_of_memory, str(tmp_path / "fixed"), None, 1)[0]["run"]
    assert auto[0]["run"]["losses"] == fixed["losses"]
    for name, weight in fixed["weights"].items():
        assert torch.equal(auto[0]["run"]["weights"][name], weight), name
