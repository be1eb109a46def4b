"""A tiny MPT trained a few steps through the Trainer, with or without an algorithm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers import TINY_MPT, token_batches

from foundry.core import Algorithm, Callback, State
from foundry.models import MPTCausalLM
from foundry.trainer import Trainer


class LossRecorder(Callback):
    """Each batch's mean training loss, as a float (read once training is over)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def batch_end(self, state: State, logger: Any) -> None:
        self.losses.append(state.loss.detach().clone())

    def values(self) -> list[float]:
        return [loss.item() for loss in self.losses]


def train_tiny_mpt(
    algorithms: Sequence[Algorithm] = (),
    num_batches: int = 3,
    precision: str = "fp32",
    tmp_path: Any = None,
    model_keys: dict[str, Any] | None = None,
    callbacks: Sequence[Callback] = (),
    **trainer_kwargs: Any,
) -> tuple[Trainer, list[float]]:
    """Train a 2-layer MPT (d_model 64, seq 16; ``model_keys`` override) on fixed batches; returns Trainer, losses."""
    torch.manual_seed(0)
    model = MPTCausalLM({**TINY_MPT, "max_seq_len": 16, **(model_keys or {})})
    recorder = LossRecorder()
    trainer = Trainer(
        model=model,
        train_dataloader=token_batches(num_batches, batch_size=4, seq_len=16, vocab_size=TINY_MPT["vocab_size"]),
        max_duration=f"{num_batches}ba",
        algorithms=algorithms,
        callbacks=[recorder, *callbacks],
        precision=precision,
        device="cpu",
        log_to_console=False,
        run_folder=str(tmp_path / "run") if tmp_path is not None else None,
        **trainer_kwargs,
    )
    trainer.fit()
    return trainer, recorder.values()


@pytest.fixture
def train(tmp_path):
    """``train(algorithms, ...)`` -> (trainer, losses): the tiny MPT run, writing under ``tmp_path``."""

    def run(algorithms: Sequence[Algorithm] = (), **kwargs: Any) -> tuple[Trainer, list[float]]:
        return train_tiny_mpt(algorithms, tmp_path=tmp_path, **kwargs)

    return run
