"""Kernel tests run the Triton kernels compiled on the GPU where there is one, else on CPU tensors through
Triton's interpreter (never the interpreter on a GPU machine: it is slow there, and some Triton and NumPy
versions of GPU images break it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """Tensors are made on the GPU when there is one; else ``TRITON_INTERPRET=1`` (foundry's kernels decide
    compile vs interpret at launch, so setting it here works)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        yield torch.device("cpu")
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.set_default_device("cuda")
    try:
        yield torch.device("cuda", torch.cuda.current_device())
    finally:
        torch.set_default_device(None)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """Compare in fp32: fp32 results to 1e-5 relative, bf16 ones to bf16's precision (2^-8, a few ulps)."""
    return _assert_close
