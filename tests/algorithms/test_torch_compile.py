"""torch_compile compiles each block in place: same losses, same parameter names.

The parity test uses dynamo's ``aot_eager`` backend: it traces forward and backward graphs as inductor
does, without inductor's C++/Triton code generation, which takes minutes on a 2-core CPU runner.
"""

from __future__ import annotations

import pytest
import torch

from foundry.algorithms import TorchCompile
from foundry.errors import ConfigError
from foundry.trainer import Trainer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_blocks_train_to_the_same_losses(train):
    _, eager = train()
    _, compiled = train([TorchCompile(backend="aot_eager", compile_loss=True)])
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_compile_keeps_parameter_names(train):
    trainer, _ = train([TorchCompile(backend="aot_eager")], num_batches=1)
    names = [name for name, _ in trainer.state.model.named_parameters()]
    assert "transformer.blocks.0.attn.Wqkv.weight" in names
    assert not any("_orig_mod" in name for name in names)


def test_every_block_forward_is_compiled(train):
    trainer, _ = train([TorchCompile(backend="aot_eager")], num_batches=1)
    blocks = trainer.state.model.transformer.blocks
    assert all("forward" in vars(block) for block in blocks)  # an instance attribute: the compiled function


def test_model_without_blocks_is_a_config_error(tiny_lm):
    with pytest.raises(ConfigError, match="torch_compile found no transformer blocks"):
        Trainer(model=tiny_lm, algorithms=[TorchCompile(backend="eager")], device="cpu", log_to_console=False)


def test_whole_model_compile_trains_to_the_same_losses(train):
    _, eager = train()
    trainer, compiled = train([TorchCompile(backend="aot_eager", scope="model")])
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert "forward" in vars(trainer.state.model)
    assert not any("forward" in vars(block) for block in trainer.state.model.transformer.blocks)


def test_whole_model_compile_runs_the_fused_loss_outside_the_graph(train):
    fused = {"loss_fn": "fused_crossentropy"}
    _, eager = train(model_keys=fused)
    _, compiled = train([TorchCompile(backend="aot_eager", scope="model")], model_keys=fused)
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_mode_and_options_together_are_a_config_error():
    with pytest.raises(ConfigError, match="both mode .* and options"):
        TorchCompile(mode="max-autotune", options={"coordinate_descent_tuning": True})


def test_unknown_scope_is_a_config_error():
    with pytest.raises(ConfigError, match="scope is 'layers'"):
        TorchCompile(scope="layers")


def test_unknown_inductor_option_is_a_config_error_naming_close_ones():
    with pytest.raises(ConfigError, match="'coordinate_decent_tuning'.*Did you mean coordinate_descent_tuning"):
        TorchCompile(options={"coordinate_decent_tuning": True})


def test_options_and_scope_reach_torch_compile(train, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append((fn, kwargs)) or fn)
    options = {"coordinate_descent_tuning": True}
    trainer, _ = train([TorchCompile(scope="model", options=options)], num_batches=1)
    ((compiled, kwargs),) = calls
    assert compiled == trainer.state.model.forward and kwargs["options"] == options
