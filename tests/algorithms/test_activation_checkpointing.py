"""activation_checkpointing recomputes chosen modules in backward: same losses, chosen modules wrapped."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from foundry.algorithms import ActivationCheckpointing
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError


def deprecated_algorithm(**keys: Any) -> ActivationCheckpointing:
    """The algorithm, still supported under its deprecated name: it warns."""
    with pytest.warns(FutureWarning, match="algorithms.activation_checkpointing is deprecated"):
        return ActivationCheckpointing(**keys)


def _wrapped(trainer) -> list[str]:
    model = trainer.state.model
    return [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]


def test_checkpointed_blocks_train_to_the_same_losses(train):
    _, plain = train()
    trainer, checkpointed = train([deprecated_algorithm()])
    assert checkpointed == pytest.approx(plain, rel=1e-6)
    assert _wrapped(trainer) == ["transformer.blocks.0", "transformer.blocks.1"]


def test_per_module_type_wraps_only_attention(train):
    trainer, _ = train([deprecated_algorithm(target=["attention"])], num_batches=1)
    assert _wrapped(trainer) == ["transformer.blocks.0.attn", "transformer.blocks.1.attn"]


def test_per_block_selection_wraps_the_chosen_blocks(train):
    trainer, _ = train([deprecated_algorithm(target={"mptblock": "last-1"})], num_batches=1)
    assert _wrapped(trainer) == ["transformer.blocks.1"]


def test_checkpointing_twice_is_a_config_error(train):
    """What fsdp_config.activation_checkpointing does after the algorithm ran (without a process group here)."""
    trainer, _ = train([deprecated_algorithm()], num_batches=1)
    model = trainer.state.model
    with pytest.raises(ConfigError, match="both on"):
        apply_activation_checkpointing(model, blocks_of(model), target=None, reentrant=False)


def test_the_algorithm_is_the_deprecated_spelling_of_fsdp_configs_switch() -> None:
    with pytest.warns(FutureWarning, match="algorithms.activation_checkpointing is deprecated.*fsdp_config"):
        ActivationCheckpointing()
