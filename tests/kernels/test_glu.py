from __future__ import annotations

import pytest
import torch

from foundry.errors import FoundryError
from foundry.kernels.glu import glu
from foundry.models.layers import GLU, ActFnConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("name", "approximate"), [("silu", "none"), ("gelu", "none"), ("gelu", "tanh"), ("relu", "none")]
)
@pytest.mark.parametrize("shape", [(2, 5, 77), (3, 1030)])
def test_glu_matches_foundry_glu(
    shape: tuple[int, ...], name: str, approximate: str, dtype: torch.dtype, assert_close
) -> None:
    reference = GLU(4, shape[-1], ActFnConfig(name=name, approximate=approximate))
    gate = (torch.randn(shape) * 2).to(dtype).requires_grad_()
    up = torch.randn(shape).to(dtype).requires_grad_()
    expected, actual = reference.gated_act(gate, up), glu(gate, up, name, approximate)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    upstream = torch.randn(shape).to(dtype)
    for got, want in zip(
        torch.autograd.grad(actual, (gate, up), upstream),
        torch.autograd.grad(expected, (gate, up), upstream),
        strict=True,
    ):
        assert_close(got, want, dtype)


def test_glu_refuses_an_unknown_activation() -> None:
    with pytest.raises(FoundryError, match="no activation 'tanh'"):
        glu(torch.randn(4), torch.randn(4), "tanh")
