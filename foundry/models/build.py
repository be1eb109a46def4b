"""A model section of a YAML (``name`` plus the model's keys) made into the registered model."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from foundry import registry
from foundry.errors import ConfigError


def build_model(section: Mapping[str, Any], tokenizer: Any = None) -> nn.Module:
    """The registered model ``section['name']``, built from the other keys (the model validates them)."""
    model = registry.component_factory(registry.models, section, "model")()
    model_vocab_size = vocab_size(model)
    if tokenizer is not None and model_vocab_size is not None and len(tokenizer) > model_vocab_size:
        raise ConfigError(
            f"The tokenizer has {len(tokenizer)} tokens but model.vocab_size is {model_vocab_size}, so some token "
            f"ids have no embedding. Set model.vocab_size to at least {len(tokenizer)} (a multiple of 64 is fastest)."
        )
    return model


def vocab_size(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds, where it says (its ``vocab_size`` or its config's)."""
    return getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)


def checked_model_config(section: Mapping[str, Any]) -> Any:
    """The config a model section describes, its values checked without building the model (no weights, no
    download), or None where the registered model cannot check its keys alone (``hf_causal_lm`` reads its
    Hugging Face config when built) or the name is none of them (the build says so, with what else is wrong, as
    for LLM Foundry's encoder-decoder YAMLs). A model class offers this with a ``checked_config(keys)`` classmethod.
    """
    if section.get("name") not in registry.models:
        return None
    constructor = registry.component_factory(registry.models, section, "model").func  # its keys checked, by key
    checked_config = getattr(constructor, "checked_config", None)
    if checked_config is None:
        return None
    with warnings.catch_warnings():  # the model warns once, when it is built
        warnings.simplefilter("ignore")
        return checked_config({key: value for key, value in section.items() if key != "name"})
