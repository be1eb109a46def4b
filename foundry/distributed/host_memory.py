"""Whether a model built on the meta device can be created in this host's memory, asked before it is.

Rank 0 (or a single process) materialises a meta-device model whole in host memory when it cannot be initialised a
module at a time (``placement.init_on_cpu``); when it can, rank 0 holds one module whole at a time, beside the
shards the host's ranks keep in host memory (``placement._init_by_module``). A model larger than the host then dies
in the kernel's OOM killer ("Killed", no reason given) or in an allocator traceback; these checks refuse it first,
in one paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from foundry.distributed.env import get_local_world_size
from foundry.errors import ConfigError

DENSE_BYTES = 2  # a quantized weight (QLoRA's NF4) is initialised and read through its bf16 values
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # a 4-bit code, an 8-bit scale per 64, an fp32 scale per 256 scales


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``); None where unknown."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` (an FSDP2 shard: its part on this rank) holds; a tensor subclass (an NF4 weight) holds those
    of its inner tensors."""
    tensor = _local(tensor)
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def bytes_to_create(model: nn.Module) -> int:
    """Host bytes that materialising ``model``'s meta tensors takes at its peak: the weights as stored, plus the
    bf16 values of any quantized ones, which the init writes all at once and rank 0's state dict reads back."""
    tensors = [tensor for tensor in [*model.parameters(), *model.buffers()] if tensor.is_meta]
    quantized = [tensor for tensor in tensors if _is_quantized(tensor)]
    return sum(stored_bytes(t) for t in tensors) + sum(t.numel() * DENSE_BYTES for t in quantized)


def bytes_to_init_module(module: nn.Module) -> int:
    """Host bytes rank 0 holds while ``module``'s own parameters are initialised whole: their values, plus, for a
    quantized weight, its 4-bit codes and the bf16 values they dequantize to (``nf4.round_to_nf4``)."""
    total = 0
    for param in module._parameters.values():
        if param is not None:
            dense = param.numel() * param.element_size()  # an NF4 weight's dtype is bf16
            total += dense + (dense + int(param.numel() * NF4_BITS / 8) if _is_quantized(param) else 0)
    return total


def bytes_to_init_by_module(modules: list[nn.Module], kept_bytes_per_rank: int, ranks_on_host: int) -> int:
    """Host bytes a module-at-a-time init takes at its peak: the largest module whole on rank 0, plus the bytes
    each of the host's ranks keeps in host memory (its shards, on a CPU or with ``cpu_offload``; else none)."""
    largest = max((bytes_to_init_module(module) for module in modules), default=0)
    return largest + kept_bytes_per_rank * ranks_on_host


def check_fits_by_module(model: nn.Module, modules: list[nn.Module], device: torch.device) -> None:
    """Refuse a sharded model whose module-at-a-time init this host cannot hold (``bytes_to_init_by_module``)."""
    kept = sum(stored_bytes(p) for p in model.parameters() if _local(p).device.type == "cpu")
    needed = bytes_to_init_by_module(modules, kept, get_local_world_size())
    available = available_host_bytes()
    if available is None or needed <= available:
        return
    raise ConfigError(
        f"Initialising the model one module at a time takes {needed / 1e9:.1f} GB of host memory on this machine "
        f"(rank 0's largest module whole, plus the shards its {get_local_world_size()} ranks keep in host memory: "
        f"{kept / 1e9:.1f} GB each), but it has {available / 1e9:.1f} GB available, so it would be killed for lack "
        f"of memory. Spread the job over more hosts (`--nnodes`), keep the shards on the GPUs (fsdp_config."
        "cpu_offload: false), or run on a machine with more host memory."
    )


def bytes_to_gather(model: nn.Module, dtype: torch.dtype) -> int:
    """Host bytes rank 0 holds when a sharded ``model``'s whole state dict is gathered to its CPU and copied to
    ``dtype`` (a Hugging Face export): every tensor as the state dict gives it (a 4-bit weight as its bf16
    values), plus the copy."""
    tensors = [*model.parameters(), *model.buffers()]
    gathered = sum(tensor.numel() * tensor.element_size() for tensor in tensors)  # an NF4 weight's dtype is bf16
    return gathered + sum(tensor.numel() for tensor in tensors) * dtype.itemsize


def check_gather_fits(model: nn.Module, dtype: torch.dtype, what: str) -> None:
    """Refuse, at the start of a run, a whole-model export (``what``) that would not fit rank 0's host memory."""
    needed, available = bytes_to_gather(model, dtype), available_host_bytes()
    if available is None or needed <= available:
        return
    raise ConfigError(
        f"{what} gathers the whole model to rank 0's host memory and copies it to {str(dtype).removeprefix('torch.')}: "
        f"{needed / 1e9:.1f} GB, "
        f"but this machine has {available / 1e9:.1f} GB available, so the first export would be killed for lack "
        "of memory, after training. Remove it and convert the run's sharded checkpoint afterwards: a LoRA run's "
        "adapters with `foundry convert export-adapter CKPT OUT` (on any machine), or the whole model with "
        "`foundry convert to-hf CKPT OUT` (a LoRA run's after `foundry convert merge`) on a machine with that much "
        "memory."
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # an FSDP2 shard's part on this rank


def _is_quantized(tensor: torch.Tensor) -> bool:
    return type(_local(tensor)) not in (torch.Tensor, nn.Parameter)


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
            "Rank 0 creates the whole model in host memory before its shards reach the GPUs (this model is not "
            "initialised a module at a time); run on a machine with more host memory."
        )
    raise ConfigError(
        f"The model ({parameters / 1e9:.1f}B parameters) takes {needed / 1e9:.1f} GB of host memory to create "
        f"(its weights as stored, plus the bf16 values of its 4-bit ones, which the init writes), but this "
        f"machine has {available / 1e9:.1f} GB available, so it would be killed for lack of memory. {fix}"
    )
