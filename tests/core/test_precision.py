"""The default precision follows the device: amp_bf16 on a GPU, fp32 on a CPU (where bf16 autocast is slow)."""

from __future__ import annotations

import pytest
import torch

from foundry.core.precision import check_precision
from foundry.errors import ConfigError


@pytest.mark.parametrize(("device", "resolved"), [("cpu", "fp32"), ("cuda", "amp_bf16")])
def test_auto_resolves_by_device(device: str, resolved: str) -> None:
    assert check_precision("auto", torch.device(device)) == resolved


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_a_named_precision_is_kept_on_a_cpu(precision: str) -> None:
    assert check_precision(precision, torch.device("cpu")) == precision


def test_an_unknown_precision_lists_auto_among_the_choices() -> None:
    with pytest.raises(ConfigError, match="choose one of auto, fp32, amp_bf16, amp_fp16"):
        check_precision("bf16", torch.device("cpu"))
