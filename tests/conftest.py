"""Shared fixtures: fixed seeds, the shared data folder, a tiny tokenizer."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FakeClock, TinyLM

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FOUNDRY_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; tests that use it skip cleanly when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture
def tiny_lm() -> TinyLM:
    return TinyLM()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test sets ``clock.now``."""
    return FakeClock()
