"""A model section of a YAML (``name`` plus the model's keys) made into the registered model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from foundry import registry
from foundry.errors import ConfigError


def build_model(section: Mapping[str, Any], tokenizer: Any = None) -> nn.Module:
    """The registered model ``section['name']``, built from the other keys (the model validates them)."""
    model = registry.component_factory(registry.models, section, "model")()
    model_vocab_size = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if tokenizer is not None and model_vocab_size is not None and len(tokenizer) > model_vocab_size:
        raise ConfigError(
            f"The tokenizer has {len(tokenizer)} tokens but model.vocab_size is {model_vocab_size}, so some token "
            f"ids have no embedding. Set model.vocab_size to at least {len(tokenizer)} (a multiple of 64 is fastest)."
        )
    return model
