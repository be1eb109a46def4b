"""LoRA: a frozen linear layer plus a trainable low-rank update, ``y = W x + b + scaling · B A dropout(x)``.

``model.peft_config`` (LLM Foundry's key, PEFT's ``LoraConfig`` names) turns it on: ``inject_lora``
replaces each targeted ``nn.Linear`` by a ``LoRALinear`` that keeps the same ``weight`` and ``bias``
parameters (so base checkpoints load by name) and adds ``lora_A`` (r × in) and ``lora_B`` (out × r),
initialised as PEFT does (A kaiming-uniform, B zeros: the model starts as the base). Every other
parameter is frozen, so the optimizer sees only the adapters. With ``quantize_base`` (QLoRA) the adapted
layers' frozen weights are stored in 4-bit NF4 (``foundry.models.nf4``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from foundry.distributed.protocol import InitStep
from foundry.errors import ConfigError, did_you_mean
from foundry.models.nf4 import (
    count_shard_blocks,
    dequantize,
    is_nf4,
    place_stranded_parts,
    quantize_weights,
    round_to_nf4,
    torchao_nf4,
)

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
_ADAPTER_KEY = re.compile(r"\.lora_[AB]\.weight$")
_OUTPUT_HEADS = ("lm_head",)
_NF4_KEPT_AS_CODES = contextvars.ContextVar("nf4_kept_as_codes", default=False)


@dataclasses.dataclass
class LoraConfig:
    """``model.peft_config``: PEFT's ``LoraConfig`` keys that foundry implements, plus ``save_adapters_only``."""

    peft_type: Literal["LORA"] = "LORA"
    task_type: Literal["CAUSAL_LM"] = "CAUSAL_LM"
    r: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None  # names (a module matches its last parts), a regex, or all-linear
    bias: Literal["none"] = "none"
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r
    save_adapters_only: bool = False  # checkpoints hold the adapters (and their optimizer state), not the base
    quantize_base: bool = False  # QLoRA: the adapted layers' frozen weights stored in 4-bit NF4 (torchtune's name)
    base_dtype: Literal["float32", "bfloat16"] = "float32"  # how the other frozen weights are stored

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ConfigError(f"'model.peft_config.r' is {self.r}; the LoRA rank must be positive (e.g. 8).")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"'model.peft_config.lora_dropout' is {self.lora_dropout}; a probability in [0, 1).")
        if self.target_modules is None or self.target_modules == []:
            raise ConfigError(
                "'model.peft_config.target_modules' is missing: list the linear layers that get adapters, e.g. "
                f"[Wqkv, out_proj, up_proj, down_proj], or '{ALL_LINEAR}'."
            )
        if self.quantize_base:
            torchao_nf4()  # refused here, at parsing, when torchao is missing

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoRALinear(nn.Linear):
    """``base`` (its own weight and bias, frozen) plus ``scaling · lora_B(lora_A(dropout(x)))``."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float) -> None:
        nn.Module.__init__(self)
        # Same parameters and attributes (in/out_features, init hints such as is_residual_output).
        self.__dict__.update({key: value for key, value in base.__dict__.items() if not key.startswith("_")})
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=device)  # kaiming-uniform(a=sqrt(5))
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = scaling
        self.adapter_enabled = True  # off: the base layer alone (the reference model of preference tuning)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """PEFT's initialisation: A as ``nn.Linear``'s default, B zeros, so the update starts at 0."""
        if self.lora_A.weight.is_meta:
            return
        self.lora_A.reset_parameters()
        nn.init.zeros_(self.lora_B.weight)

    def reset_parameters(self) -> None:  # init_config 'default_' resets every module this way
        if hasattr(self, "lora_A"):
            super().reset_parameters()
            self.reset_lora_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An NF4 weight dequantizes to x's dtype inside F.linear, one layer at a time.
        base = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return base
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """``W + scaling · B A``: the plain linear layer that computes the same function (without dropout)."""
        return dequantize(self.weight) + self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LoRALinear:
        super()._apply(fn, recurse)
        place_stranded_parts(self.weight)  # QLoRA after to_empty: the whole NF4 weight on the new device
        return self

    def after_sharding(self) -> None:  # foundry.distributed.protocol.ShardedLayer
        count_shard_blocks(self.weight)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """An NF4 base weight is saved as its bf16 values, so checkpoints and exports read as the base's."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_nf4(self.weight) and not _NF4_KEPT_AS_CODES.get():
            destination[prefix + "weight"] = dequantize(self.weight).detach()

    def extra_repr(self) -> str:
        nf4 = ", base=nf4" if is_nf4(self.weight) else ""
        return f"{super().extra_repr()}{nf4}, r={self.lora_A.out_features}, scaling={self.scaling:g}"


@contextlib.contextmanager
def nf4_weights_kept_as_codes() -> Iterator[None]:
    """Within: state dicts hold NF4 weights as they are stored, not as bf16 values, for a caller that drops them.

    Dequantizing a rank's whole share at once is 4× its NF4 bytes (200 GB a rank for Llama-405B on 4 GPUs).
    """
    token = _NF4_KEPT_AS_CODES.set(True)
    try:
        yield
    finally:
        _NF4_KEPT_AS_CODES.reset(token)


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key is a LoRA tensor (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return bool(_ADAPTER_KEY.search(name))


def inject_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Replace the targeted linear layers of ``model`` by ``LoRALinear`` and freeze everything else.

    Returns:
        The names of the modules that got adapters.

    Raises:
        ConfigError: a ``target_modules`` entry matches no linear layer (the message lists them).
    """
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    targets = _matching_modules(linears, config.target_modules)
    for name in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, LoRALinear(linears[name], config.r, config.scaling, config.lora_dropout))
    if config.quantize_base:
        quantize_weights((name, model.get_submodule(name)) for name in targets)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter_key(name))
    store_frozen_weights(model, getattr(torch, config.base_dtype))
    return targets


def store_frozen_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep ``model``'s frozen floating-point weights in ``dtype`` (NF4 ones stay NF4; adapters stay fp32).

    A frozen weight needs no fp32 master copy: under bf16 autocast or FSDP2's bf16 ``param_dtype`` every GEMM
    reads it in bf16 anyway, so storing it so halves the base's memory without changing what is computed.
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.requires_grad and parameter.is_floating_point() and not is_nf4(parameter):
                parameter.data = parameter.data.to(dtype)


def _matching_modules(linears: dict[str, nn.Linear], target_modules: list[str] | str | None) -> list[str]:
    """PEFT's matching: a list entry matches a module whose dotted name ends with it; a string is a regex."""
    if target_modules == ALL_LINEAR:
        return [name for name in linears if name.rpartition(".")[2] not in _OUTPUT_HEADS]
    if isinstance(target_modules, str):
        matches = [name for name in linears if re.fullmatch(target_modules, name)]
        if not matches:
            raise _no_match_error(repr(target_modules) + " (a regex over full module names)", linears)
        return matches
    matches = []
    for target in target_modules or []:
        found = [name for name in linears if name == target or name.endswith("." + target)]
        if not found:
            raise _no_match_error(repr(target), linears)
        matches += [name for name in found if name not in matches]
    return matches


def _no_match_error(target: str, linears: dict[str, nn.Linear]) -> ConfigError:
    short_names = sorted({name.rpartition(".")[2] for name in linears})
    hint = did_you_mean(target.strip("'"), short_names) if "regex" not in target else ""
    return ConfigError(
        f"'model.peft_config.target_modules' entry {target} matches no linear layer of this model.{hint} Its linear "
        f"layers are named {', '.join(short_names)} (e.g. {next(iter(linears), 'none')}); or use '{ALL_LINEAR}'."
    )


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) of every LoRA layer of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside the block: every LoRA layer computes ``W x + b`` alone."""
    layers = [module for _, module in lora_modules(model)]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def reset_lora_parameters(model: nn.Module) -> None:
    """Re-initialise every adapter of ``model`` (after the base init, which also touches lora_A/B)."""
    for _, module in lora_modules(model):
        module.reset_lora_parameters()


def init_steps(model: nn.Module, init_module: Callable[[nn.Module], None]) -> list[InitStep]:
    """A model's ``init_weights`` one module at a time, in its order: ``init_module`` on each of ``modules()`` (an
    NF4 weight's values then rounded to 4 bits, as ``dense_weights`` stores them), then each adapter again, as
    ``reset_lora_parameters`` draws it (``foundry.distributed.protocol.ModuleByModuleInit``)."""
    base = [
        (module, _then_rounded_to_nf4(init_module) if is_nf4(getattr(module, "weight", None)) else init_module)
        for module in model.modules()
    ]
    adapters = [
        step
        for _, layer in lora_modules(model)
        for step in [(layer.lora_A, nn.Linear.reset_parameters), (layer.lora_B, _zero_weight)]
    ]
    return base + adapters


def _then_rounded_to_nf4(init_module: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    def init_and_round(module: nn.Module) -> None:
        init_module(module)
        round_to_nf4(module.weight)

    return init_and_round


def _zero_weight(linear: nn.Module) -> None:
    nn.init.zeros_(linear.weight)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``model`` by state-dict key (``...Wqkv.lora_A.weight``)."""
    return {name: tensor for name, tensor in model.state_dict().items() if is_adapter_key(name)}


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each LoRA layer folded into its weight: the base model's keys and shapes.

    Each merged weight is summed in fp32 and rounded to ``dtype`` (None: kept as summed) before the next is
    summed, and the NF4 weights the merged ones replace are never dequantized whole-model at once.
    """
    merged = {}
    for name, module in lora_modules(model):
        weight = module.merged_weight().detach()
        merged[f"{name}.weight"] = weight if dtype is None else weight.to(dtype)
    with nf4_weights_kept_as_codes():  # every NF4 weight is a LoRA layer's, replaced by its merged weight
        state = model.state_dict()
    return {name: merged.get(name, tensor) for name, tensor in state.items() if not is_adapter_key(name)}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that need gradients: what an optimizer gets, so frozen weights have no optimizer state."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]
