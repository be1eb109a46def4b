"""Many adapters, one base: keep each adapter's tensors beside the model and copy one set in to switch.

The base weights are loaded once; a switch copies only the LoRA tensors (r · (in + out) numbers per
adapted layer) into the model's ``lora_A``/``lora_B`` parameters in place, so nothing is reallocated
and a compiled or sharded-free model keeps its parameters::

    adapters = AdapterSet(model)                      # model: a LoRA model with its base loaded
    adapters.load("math", "runs/math/ckpt")           # a LoRA run's checkpoint (adapters-only or full)
    adapters.load("code", "runs/code/ckpt")
    seconds = adapters.activate("math")
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from foundry.checkpoint import resolve_checkpoint_path
from foundry.errors import ConfigError
from foundry.models.lora import adapter_state_dict
from foundry.models.lora_checkpoint import read_adapter_tensors


class AdapterSet:
    """Named adapter tensors for one LoRA ``model``, switched into it with ``activate``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._parameters = {name: tensor for name, tensor in adapter_state_dict(model).items()}
        if not self._parameters:
            raise ConfigError("AdapterSet needs a LoRA model (one built with model.peft_config); this one has none.")
        self._adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def add(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (the model's adapter keys and shapes) as adapter ``name``, on the model's device."""
        missing, unexpected = set(self._parameters) - set(tensors), set(tensors) - set(self._parameters)
        if missing or unexpected:
            raise ConfigError(
                f"Adapter '{name}' does not fit this model: missing {sorted(missing)[:3]}, unexpected "
                f"{sorted(unexpected)[:3]}. Adapters on one base need the same peft_config r and target_modules."
            )
        for key, tensor in tensors.items():
            if tensor.shape != self._parameters[key].shape:
                raise ConfigError(
                    f"Adapter '{name}': {key} is {tuple(tensor.shape)}, the model's is "
                    f"{tuple(self._parameters[key].shape)}; was it trained with another rank r?"
                )
        like = self._parameters
        self._adapters[name] = {key: tensor.to(like[key].device, like[key].dtype) for key, tensor in tensors.items()}

    def load(self, name: str, checkpoint: str | Path) -> None:
        """Read adapter ``name`` from a LoRA run's checkpoint (a checkpoint folder or its save_folder)."""
        self.add(name, read_adapter_tensors(resolve_checkpoint_path(checkpoint), self._parameters))

    @torch.no_grad()
    def activate(self, name: str) -> float:
        """Copy adapter ``name`` into the model; returns the seconds the switch took (device work included)."""
        if name not in self._adapters:
            raise ConfigError(f"No adapter named '{name}'; loaded: {', '.join(self._adapters) or 'none'}.")
        start = time.perf_counter()
        for key, tensor in self._adapters[name].items():
            self._parameters[key].copy_(tensor)
        if any(t.is_cuda for t in self._parameters.values()):
            torch.cuda.synchronize()
        self.active = name
        return time.perf_counter() - start
