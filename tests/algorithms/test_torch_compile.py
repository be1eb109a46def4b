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
