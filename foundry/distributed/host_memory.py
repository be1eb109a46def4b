"""Whether a model built on the meta device can be created in this host's memory, asked before it is.

Rank 0 (or a single process) materialises a meta-device model whole in host memory when it cannot be initialised a
module at a time (``placement.init_on_cpu``). A model larger than the host then dies in the kernel's OOM killer
("Killed", no reason given) or in an allocator traceback; this check refuses it first, in one paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from foundry.errors import ConfigError

DENSE_BYTES = 2  # a quantized weight (QLoRA's NF4) is initialised and read through its bf16 values


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``); None where unknown."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` holds; a tensor subclass (an NF4 weight) holds those of its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def bytes_to_create(model: nn.Module) -> int:
    """Host bytes that materialising ``model``'s meta tensors takes at its peak: the weights as stored, plus the
    bf16 values of any quantized ones, which the init writes all at once and rank 0's state dict reads back."""
    tensors = [tensor for tensor in [*model.parameters(), *model.buffers()] if tensor.is_meta]
    quantized = [tensor for tensor in tensors if type(tensor) not in (torch.Tensor, nn.Parameter)]
    return sum(stored_bytes(t) for t in tensors) + sum(t.numel() * DENSE_BYTES for t in quantized)


def check_fits_in_host_memory(model: nn.Module, device: torch.device) -> None:
    """Refuse, before any allocation, a meta-device model that this host cannot create whole."""
    needed, available = bytes_to_create(model), available_host_bytes()
    if available is None or needed <= available:
        return
    parameters = sum(parameter.numel() for parameter in model.parameters())
    if device.type == "cpu":
        fix = (
            "A model this size trains on GPUs: run `foundry train CFG --nproc N` on a GPU machine (`foundry train "
            "CFG --dry-run --world-size N` here shows each GPU's share), or shrink the model section to try the "
            "config on this CPU."
        )
    else:
        fix = (
            "Rank 0 creates the whole model in host memory before its shards reach the GPUs (a LoRA model is not "
            "initialised a module at a time); run on a machine with more host memory."
        )
    raise ConfigError(
        f"The model ({parameters / 1e9:.1f}B parameters) takes {needed / 1e9:.1f} GB of host memory to create "
        f"(its weights as stored, plus the bf16 values of its 4-bit ones, which the init writes), but this "
        f"machine has {available / 1e9:.1f} GB available, so it would be killed for lack of memory. {fix}"
    )
