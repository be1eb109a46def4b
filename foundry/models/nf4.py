"""QLoRA's frozen base: linear weights stored as 4-bit NormalFloat (NF4) tensors from torchao.

torchao's ``NF4Tensor`` (the one torchtune's QLoRA uses) keeps two 4-bit codes per byte, one 8-bit scale per
64 weights and one fp32 scale per 256 of those (double quantization): about 4.13 bits a weight. It
implements FSDP2's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``, so ``fully_shard`` splits the codes by
rows and each block's all-gather moves them in 4 bits; ``F.linear`` dequantizes to the input's dtype.
torchao is optional: it is imported here, when ``model.peft_config.quantize_base`` asks for it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType

import torch
from torch import nn

from foundry.errors import ConfigError
from foundry.optional import import_optional

KEY = "model.peft_config.quantize_base"
BLOCK_SIZE = 64  # weights per 4-bit scale block (QLoRA's)
SCALER_BLOCK_SIZE = 256  # block scales per double-quantization block
BASE_DTYPE = torch.bfloat16  # the dtype the codes dequantize to: QLoRA's compute dtype


def torchao_nf4() -> ModuleType:
    """torchao's module holding ``NF4Tensor`` and ``to_nf4`` (``torchao.quantization`` from 0.18, ``torchao.dtypes``
    before), or a ConfigError naming the key and the install."""
    quantization = import_optional(
        "torchao.quantization", needed_for=f"'{KEY}: true' (4-bit NF4 base weights)",
        package="torchao (NF4 tensors that FSDP2 shards)", install="pip install torchao", error=ConfigError,
    )  # fmt: skip
    return quantization if hasattr(quantization, "NF4Tensor") else importlib.import_module("torchao.dtypes")


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or, for an FSDP2 shard, its local part) holds NF4 codes."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a plain ``BASE_DTYPE`` tensor (a DTensor stays one, with a plain local part)."""
    if not is_nf4(tensor):
        return tensor
    if hasattr(tensor, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        local = tensor._local_tensor.get_original_weight()
        mesh, placements = tensor.device_mesh, tensor.placements
        return DTensor.from_local(local, mesh, placements, shape=tensor.shape, stride=tensor.stride())
    return tensor.get_original_weight()


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` (or an FSDP2 shard's local part) holds: for NF4, its codes, scales and code table."""
    local = getattr(tensor, "_local_tensor", tensor)
    if not is_nf4(local):
        return local.numel() * local.element_size()
    parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor, local.scaler_mean, local.nf4)
    return sum(part.numel() * part.element_size() for part in parts)


def dequantized_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor``'s (or an FSDP2 shard's local part's) values take dequantized: 0 unless it holds NF4 codes."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local.numel() * BASE_DTYPE.itemsize if is_nf4(local) else 0


def check_quantizable(name: str, weight: torch.Tensor) -> None:
    """NF4 needs whole scale blocks: ``weight.numel()`` a multiple of 64 × 256 (per FSDP2 shard, too)."""
    per_block = BLOCK_SIZE * SCALER_BLOCK_SIZE
    if weight.dim() != 2 or weight.numel() % per_block:
        raise ConfigError(
            f"'{KEY}': {name}.weight is {tuple(weight.shape)}, whose {weight.numel()} numbers are not a multiple of "
            f"{per_block} ({BLOCK_SIZE}-weight blocks, {SCALER_BLOCK_SIZE} block scales per double-quantization "
            "block), so it cannot be stored in NF4. Leave this layer out of target_modules, or set quantize_base: "
            "false."
        )


def quantize_weights(linears: Iterable[tuple[str, nn.Linear]]) -> None:
    """Replace each linear layer's weight by a frozen NF4 parameter (of its values cast to bf16; meta stays meta)."""
    linears = list(linears)
    if not linears:  # a model without a 4-bit base never imports torchao
        return
    nf4 = torchao_nf4()
    for name, linear in linears:
        if is_nf4(linear.weight):
            continue
        check_quantizable(name, linear.weight)
        with _one_chunk_on_meta(nf4, linear.weight):
            codes = nf4.to_nf4(linear.weight.detach().to(BASE_DTYPE), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        linear.weight = nn.Parameter(codes, requires_grad=False)


@contextlib.contextmanager
def _one_chunk_on_meta(nf4: ModuleType, weight: torch.Tensor) -> Iterator[None]:
    """torchao quantizes in chunks of 2^20 weights to bound memory; a meta tensor has none, and its thousands of
    chunks took 4 minutes for Llama-405B's shapes, so meta weights are quantized in one chunk."""
    chunked = sys.modules[nf4.NF4Tensor.__module__]
    if not weight.is_meta or not hasattr(chunked, "CHUNK_SIZE"):
        yield
        return
    chunk_size, chunked.CHUNK_SIZE = chunked.CHUNK_SIZE, weight.numel()
    try:
        yield
    finally:
        chunked.CHUNK_SIZE = chunk_size


def place_stranded_parts(weight: torch.Tensor) -> None:
    """After ``to_empty`` from meta: put an NF4 weight's (or shard's) code table and scale mean beside its codes.

    torchao's ``empty_like`` moves only the codes and scales, leaving those two on the meta device, where a
    later ``copy_`` of values would not reach them. They are allocated as NaN, so the weight reads as unset
    (``check_weights_loaded``) until a checkpoint or rank 0's weights are copied in.
    """
    local = getattr(weight, "_local_tensor", weight)
    if not is_nf4(local) or local.quantized_data.is_meta or not local.nf4.is_meta:
        return
    device = local.quantized_data.device
    local.nf4 = torch.full(local.nf4.shape, float("nan"), dtype=local.nf4.dtype, device=device)
    local.scaler_mean = torch.full(local.scaler_mean.shape, float("nan"), dtype=local.scaler_mean.dtype, device=device)


def count_shard_blocks(weight: torch.Tensor) -> None:
    """Give an FSDP2 shard of an NF4 weight its own block count (torchao's split keeps the whole weight's).

    torchao's ``copy_`` into an NF4 tensor compares block counts with the quantized source, so without this
    copying values into a shard (rank 0's weights, a checkpoint) recurses without end. The gathered weight
    dequantizes from its codes and scales alone, so the count it carries does not matter.
    """
    local = getattr(weight, "_local_tensor", None)
    if local is not None and is_nf4(local):
        local.n_blocks = local.numel() // local.block_size


@torch.no_grad()
def round_to_nf4(weight: torch.Tensor) -> None:
    """Replace ``weight``'s bf16 values by what their NF4 codes dequantize to: what a quantized model holds."""
    nf4 = torchao_nf4()
    weight.copy_(nf4.to_nf4(weight.detach(), BLOCK_SIZE, SCALER_BLOCK_SIZE).get_original_weight())


@contextlib.contextmanager
def dense_weights(model: nn.Module) -> Iterator[None]:
    """Within: each NF4 weight of ``model`` is a plain, uninitialised bf16 parameter, for an init scheme to write;
    after: each is quantized again (what the init wrote, in 4 bits)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and is_nf4(m.weight)]
    for _, linear in linears:
        empty = torch.empty(linear.weight.shape, dtype=BASE_DTYPE, device=linear.weight.device)
        linear.weight = nn.Parameter(empty, requires_grad=False)
    yield
    quantize_weights(linears)


def float8_refusal() -> ConfigError:
    """NF4 and float8 both replace how the base's GEMMs read their weights: one model cannot have both."""
    return ConfigError(
        f"'{KEY}: true' (QLoRA) and algorithms.float8 cannot be combined: NF4 base weights are dequantized to bf16 "
        "for each GEMM, and float8 would cast the other layers' GEMMs, saving little while rounding twice. Remove "
        "algorithms.float8, or set quantize_base: false for float8 LoRA."
    )


def full_finetuning_refusal(key: str) -> ConfigError:
    """NF4 weights are frozen codes: only adapters beside them train."""
    return ConfigError(
        f"'{key}': 4-bit NF4 weights are frozen codes that no optimizer step can update, so a full finetune cannot "
        f"store them in NF4. For QLoRA set '{KEY}: true' inside a peft_config (LoRA adapters train in fp32 beside "
        "the NF4 base); for a full finetune remove the key."
    )
