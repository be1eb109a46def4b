"""Model families: ``base`` (the Trainer's interface), shared ``layers`` and ``attention``, one module per family."""

from foundry.models.base import CausalLM, FoundryModel
from foundry.models.mpt import MPTCausalLM, MPTConfig

__all__ = ["CausalLM", "FoundryModel", "MPTCausalLM", "MPTConfig"]
