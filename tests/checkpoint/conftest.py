"""A tiny trained run state to checkpoint: 2-layer MLP, AdamW, LambdaLR."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from foundry.checkpoint.integrity import hash_files, manifest_text
from foundry.core import State, Time


def make_state(seed: int = 0) -> State:
    """A fresh (untrained) state; the same seed gives the same initial weights."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    return State(model=model, max_duration=Time.parse("10ba"), optimizers=[optimizer], schedulers=[scheduler])


def train(state: State, num_batches: int) -> State:
    """Take ``num_batches`` optimizer steps on random data, advancing the timestamp."""
    for _ in range(num_batches):
        loss = state.model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        state.optimizers[0].step()
        state.schedulers[0].step()
        state.optimizers[0].zero_grad()
        state.timestamp = state.timestamp.after_batch(samples=3, tokens=12, duration_s=0.01)
    return state


@pytest.fixture
def new_state() -> Callable[..., State]:
    return make_state


@pytest.fixture
def trained_state() -> State:
    return train(make_state(), num_batches=3)


@pytest.fixture
def train_steps() -> Callable[[State, int], State]:
    return train


def reseal(folder: Path) -> None:
    """Rewrite a checkpoint's manifest to match its files as they are now: what a crafted checkpoint carries."""
    sequence = json.loads((folder / "manifest.json").read_text())["sequence"]
    names = sorted(path.name for path in folder.iterdir() if path.is_file() and path.name != "manifest.json")
    (folder / "manifest.json").write_text(manifest_text(hash_files(folder, names), sequence))


@pytest.fixture
def resealed() -> Callable[[Path], None]:
    return reseal
