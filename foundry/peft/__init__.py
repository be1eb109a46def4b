"""Parameter-efficient finetuning: LoRA layers (``lora``), adapters-only checkpoints
(``foundry.models.lora_checkpoint``), switching adapters on one base (``adapters``) and PEFT-format export
and merging (``export``).

docs/LORA.md describes ``model.peft_config`` and the commands.
"""

from foundry.models.lora import LoraConfig, LoRALinear, adapter_state_dict, inject_lora, is_adapter_key

__all__ = ["LoRALinear", "LoraConfig", "adapter_state_dict", "inject_lora", "is_adapter_key"]
