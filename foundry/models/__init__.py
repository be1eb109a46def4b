"""Model families: ``base`` (the Trainer's interface), shared ``layers`` and ``attention``, one module per family.

Importing this package registers ``mpt_causal_lm``, ``llama_causal_lm`` and ``hf_causal_lm``.
"""

from foundry.models.base import CausalLM, FoundryModel
from foundry.models.hf import HFCausalLM, HFCausalLMConfig
from foundry.models.llama import LlamaCausalLM, LlamaConfig
from foundry.models.mpt import MPTCausalLM, MPTConfig

__all__ = [
    "CausalLM",
    "FoundryModel",
    "HFCausalLM",
    "HFCausalLMConfig",
    "LlamaCausalLM",
    "LlamaConfig",
    "MPTCausalLM",
    "MPTConfig",
]
