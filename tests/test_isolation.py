"""What each test leaves to the next: nothing (``helpers.ProcessState``, the autouse fixture in conftest.py), and
compiled-vs-eager comparisons that fail when the compiled side ran eagerly (``helpers.builds_graphs``)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import ProcessState, builds_graphs


def test_the_environment_torch_switches_and_compiler_configs_come_back() -> None:
    limit = torch._dynamo.config.recompile_limit
    state = ProcessState()
    os.environ["FOUNDRY_TEST_LEAK"] = "1"
    torch.set_default_dtype(torch.float64)
    torch._dynamo.config.recompile_limit = limit + 1
    assert state.restore() == []
    assert "FOUNDRY_TEST_LEAK" not in os.environ
    assert torch.get_default_dtype() == torch.float32
    assert torch._dynamo.config.recompile_limit == limit


def test_a_saved_tensors_hook_left_pushed_is_reported_and_popped() -> None:
    state = ProcessState()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)
    hooks.__enter__()  # never exited, as a checkpointed forward that raised leaves it on torch 2.11
    (left,) = state.restore()
    assert "saved-tensors hook" in left
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_builds_graphs_fails_a_compiled_call_that_ran_eagerly() -> None:
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    with builds_graphs():
        compiled(torch.ones(2))
    force_eager = torch.compiler.set_stance("force_eager")  # what a used-up recompile limit does, silently
    with pytest.raises(AssertionError, match="built 0 graphs"), builds_graphs(), force_eager:
        compiled(torch.ones(2))
