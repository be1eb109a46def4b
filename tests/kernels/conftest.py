"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRITON_INTERPRET=1``: foundry's kernels decide compile vs interpret at launch, so setting it here works."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """Compare in fp32: fp32 results to 1e-5 relative, bf16 ones to bf16's precision (2^-8, a few ulps)."""
    return _assert_close
