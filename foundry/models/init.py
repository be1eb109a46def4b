"""Parameter initialisation: LLM Foundry's ``init_config`` schemes (``llmfoundry/models/utils/param_init_fns.py``).

Every scheme does the same per module, with its own weight init:

- ``nn.Linear``: weight from the scheme, bias 0. A fused projection (``init_chunk_rows`` set, e.g.
  Wqkv) is initialised one head-slice at a time, so fan-based schemes see each head's own shape.
  Residual output projections (``is_residual_output``: attention ``out_proj``, FFN ``down_proj``)
  are then divided by ``sqrt(2 * n_layers)`` (or by ``init_div_is_residual`` when it is a number).
- ``nn.Embedding``: normal(``emb_init_std``), uniform(``emb_init_uniform_lim``), else the scheme.
- norms: weight 1, bias 0.

``init_weights_`` touches each parameter in place, so it works on a model materialised from the
meta device with ``to_empty`` (and, shard by shard, under FSDP2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from foundry.errors import ConfigError
from foundry.models.layers import RMSNorm

InitName = Literal[
    "kaiming_normal_",
    "kaiming_uniform_",
    "small_init_",
    "neox_init_",
    "baseline_",
    "xavier_uniform_",
    "xavier_normal_",
    "default_",
]
Nonlinearity = Literal["linear", "relu", "leaky_relu", "tanh", "sigmoid", "selu", "conv1d", "conv2d", "conv3d"]
InitFn = Callable[[torch.Tensor], torch.Tensor]
_KEY = "model.init_config"


@dataclasses.dataclass
class InitConfig:
    """``model.init_config`` with LLM Foundry's defaults (``llmfoundry/models/utils/config_defaults.py``).

    Note: as in LLM Foundry, xavier schemes use ``init_gain`` as their gain, whose default 0 gives zeros.
    """

    name: InitName = "kaiming_normal_"
    fan_mode: Literal["fan_in", "fan_out"] = "fan_in"
    init_nonlinearity: Nonlinearity = "relu"
    init_div_is_residual: bool | float = True  # True: sqrt(2 * n_layers); a number: that divisor
    emb_init_std: float | None = None
    emb_init_uniform_lim: float | list[float] | None = None  # lim -> U(-lim, lim); [a, b] -> U(a, b)
    init_std: float | None = None  # the std of baseline_
    init_gain: float = 0.0  # kaiming's negative slope ``a``; xavier's gain

    def __post_init__(self) -> None:
        if self.name == "baseline_" and self.init_std is None:
            raise ConfigError(f"'{_KEY}.name' is baseline_, which draws N(0, init_std); set '{_KEY}.init_std'.")
        if self.emb_init_std is not None and self.emb_init_uniform_lim is not None:
            raise ConfigError(f"Set only one of '{_KEY}.emb_init_std' and '{_KEY}.emb_init_uniform_lim'.")
        if isinstance(self.emb_init_uniform_lim, list) and len(self.emb_init_uniform_lim) != 2:
            raise ConfigError(f"'{_KEY}.emb_init_uniform_lim' is a list; give exactly [low, high].")


def weight_init_fn(config: InitConfig, d_model: int) -> InitFn:
    """The in-place init the scheme applies to every linear weight."""
    if config.name == "kaiming_normal_":
        return functools.partial(
            nn.init.kaiming_normal_, a=config.init_gain, mode=config.fan_mode, nonlinearity=config.init_nonlinearity
        )
    if config.name == "kaiming_uniform_":
        return functools.partial(
            nn.init.kaiming_uniform_, a=config.init_gain, mode=config.fan_mode, nonlinearity=config.init_nonlinearity
        )
    if config.name in ("small_init_", "neox_init_"):
        # Transformers without Tears (Nguyen & Salazar, 2019): close to kaiming normal.
        return functools.partial(nn.init.normal_, std=math.sqrt(2 / (5 * d_model)))
    if config.name == "baseline_":
        return functools.partial(nn.init.normal_, std=config.init_std)
    if config.name == "xavier_uniform_":
        return functools.partial(nn.init.xavier_uniform_, gain=config.init_gain)
    if config.name == "xavier_normal_":
        return functools.partial(nn.init.xavier_normal_, gain=config.init_gain)
    raise ConfigError(f"'{_KEY}.name' {config.name!r} has no weight init function.")


def residual_divisor(config: InitConfig, n_layers: int) -> float | None:
    """What residual output projections are divided by, or None for no division."""
    if config.name == "neox_init_":
        return n_layers / math.sqrt(10)  # GPT-NeoX-20B 2.3.1: small-init std / Wang-init std
    if config.init_div_is_residual is True:
        return math.sqrt(2 * n_layers)
    if config.init_div_is_residual is False:
        return None
    return float(config.init_div_is_residual)


def embedding_init_fn(config: InitConfig, weight_init: InitFn) -> InitFn:
    if config.emb_init_std is not None:
        return functools.partial(nn.init.normal_, std=config.emb_init_std)
    limit = config.emb_init_uniform_lim
    if limit is not None:
        low, high = limit if isinstance(limit, list) else (-limit, limit)
        return functools.partial(nn.init.uniform_, a=low, b=high)
    return weight_init


@torch.no_grad()
def init_weights_(model: nn.Module, config: InitConfig, n_layers: int, d_model: int) -> None:
    """Initialise every parameter of ``model`` in place with ``config``'s scheme."""
    for module in model.modules():
        init_module_(module, config, n_layers, d_model)


@torch.no_grad()
def init_module_(module: nn.Module, config: InitConfig, n_layers: int, d_model: int) -> None:
    """Initialise ``module``'s own parameters (not its children's) as ``init_weights_`` does, which calls this on
    every module in turn: a sharded placement repeats that one module at a time (foundry.distributed.placement)."""
    if config.name == "default_":  # torch's own per-module defaults, nothing else (as LLM Foundry)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        return
    weight_init = weight_init_fn(config, d_model)
    divisor = residual_divisor(config, n_layers)
    if isinstance(module, nn.Linear):
        _init_linear(module, weight_init, divisor)
    elif isinstance(module, nn.Embedding):
        embedding_init_fn(config, weight_init)(module.weight)
    elif isinstance(module, nn.LayerNorm | RMSNorm):
        nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights_with"):  # stacked expert weights (foundry/models/experts.py)
        module.init_weights_with(weight_init, divisor)
    elif any(True for _ in module.parameters(recurse=False)):
        raise TypeError(f"init_weights_ cannot initialise {type(module).__name__}; teach foundry/models/init.py.")


def _init_linear(linear: nn.Linear, weight_init: InitFn, divisor: float | None) -> None:
    chunk_rows = getattr(linear, "init_chunk_rows", None)
    for chunk in linear.weight.split(chunk_rows, dim=0) if chunk_rows else [linear.weight]:
        weight_init(chunk)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    if divisor is not None and getattr(linear, "is_residual_output", False):
        linear.weight.div_(divisor)
