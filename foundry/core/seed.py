"""The run's seed: every rank seeds every generator alike."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights everywhere (data order comes from the loader)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
