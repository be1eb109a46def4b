"""The Hugging Face families foundry converts: one row each, read by ``foundry.convert`` and the loaders.

A row names the ``transformers`` class, its ``config.json`` ``model_type``, the foundry models it exports
and the adapter module in ``foundry/convert/`` that moves the weights. It lives beside the models rather
than in ``foundry.convert`` because ``HFCausalLM`` reads it too (to point a mixture of experts to foundry's
own MoE), and ``foundry.convert`` imports the models.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HFFamily:
    module: str  # the adapter module
    hf_class: str  # the transformers class it writes and reads
    model_type: str  # config.json's model_type
    exports: tuple[str, ...]  # the foundry model names it can export; the first is the one `from-hf` builds
    built_in: bool = True  # False: the export carries its own modeling code (trust_remote_code=True)
    experts: bool = False  # a mixture of experts: foundry's MoE computes it in grouped GEMMs


# Export tries the rows in this order and takes the first whose class computes the model exactly;
# foundry's own modeling code (last) computes every MPT.
HF_FAMILIES = (
    # Mixtures of experts first: the dense classes cannot compute experts (foundry/convert/llama_moe.py, dbrx.py).
    HFFamily(
        "foundry.convert.mixtral", "MixtralForCausalLM", "mixtral", ("llama_causal_lm", "mpt_causal_lm"), experts=True
    ),
    HFFamily("foundry.convert.olmoe", "OlmoeForCausalLM", "olmoe", ("llama_causal_lm", "mpt_causal_lm"), experts=True),
    HFFamily(
        "foundry.convert.qwen3_moe",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        ("llama_causal_lm", "mpt_causal_lm"),
        experts=True,
    ),
    HFFamily("foundry.convert.dbrx", "DbrxForCausalLM", "dbrx", ("mpt_causal_lm",), experts=True),
    HFFamily("foundry.convert.llama", "LlamaForCausalLM", "llama", ("llama_causal_lm", "mpt_causal_lm")),
    HFFamily("foundry.convert.mpt", "MptForCausalLM", "mpt", ("mpt_causal_lm",)),
    HFFamily("foundry.convert.gpt2", "GPT2LMHeadModel", "gpt2", ("mpt_causal_lm",)),
    HFFamily("foundry.convert.foundry_mpt", "FoundryMPTForCausalLM", "foundry_mpt", ("mpt_causal_lm",), False),
)

# model_type -> the foundry model it becomes, for the mixtures of experts foundry converts to its own MoE
NATIVE_MOE = {family.model_type: family.exports[0] for family in HF_FAMILIES if family.experts}
