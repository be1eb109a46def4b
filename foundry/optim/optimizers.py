"""Optimizers by YAML name: ``decoupled_adamw`` (LLM Foundry's default for pretraining), ``decoupled_lionw``, ..."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from foundry import registry
from foundry.errors import ConfigError


@registry.optimizers.register("decoupled_adamw")
class DecoupledAdamW(torch.optim.AdamW):
    """AdamW whose weight decay follows the LR schedule but not the LR's magnitude.

    torch's AdamW shrinks weights by ``lr * weight_decay`` per step, so retuning ``lr`` silently
    retunes decay. Here the shrink is ``weight_decay * lr / initial_lr``: ``weight_decay`` means the
    same thing at any peak LR (Loshchilov & Hutter's decoupling, as Composer's DecoupledAdamW does).
    The Adam update itself is torch's; ``fused=None`` picks the fused kernel when every parameter is
    on a CUDA device (torch itself would pick the slower foreach one).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        fused: bool | None = None,
    ) -> None:
        params = [_listed(item) for item in params]
        if fused is None:
            fused = _all_on_cuda(params)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0, fused=fused)
        for group in self.param_groups:
            group["lr_relative_weight_decay"] = weight_decay
            group["initial_lr"] = group["lr"]
        # (torch's Adam owns the group key "decoupled_weight_decay", hence our own name.)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            decay = group["lr_relative_weight_decay"]
            if decay == 0.0 or group["initial_lr"] == 0.0:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                torch._foreach_mul_(params, 1.0 - decay * group["lr"] / group["initial_lr"])
        return super().step(closure)


@registry.optimizers.register("decoupled_lionw")
class DecoupledLionW(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with LLM Foundry's decoupled decay.

    Per parameter: ``update = sign(lerp(m, g, 1 - beta1))``, ``p -= lr * update``, ``m = lerp(m, g, 1 - beta2)``;
    before that, weights shrink by ``weight_decay * lr / initial_lr`` as in ``DecoupledAdamW``. One moment
    buffer per parameter (AdamW keeps two). Defaults are LLM Foundry's.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(
            [_listed(item) for item in params], {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        )
        for group in self.param_groups:
            group["initial_lr"] = group["lr"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            shrink = 1.0 - decay * (lr / group["initial_lr"] if group["initial_lr"] else 1.0)
            for param in group["params"]:
                if param.grad is None:
                    continue
                moment = self.state[param].setdefault("exp_avg", torch.zeros_like(param))
                if decay:
                    param.mul_(shrink)
                param.add_(moment.lerp(param.grad, 1 - beta1).sign_(), alpha=-lr)
                moment.lerp_(param.grad, 1 - beta2)
        return loss


def _listed(item: torch.Tensor | dict) -> torch.Tensor | dict:
    """A param group with its ``params`` as a list (a generator could be read only once)."""
    if not isinstance(item, dict):
        return item
    params = item["params"]
    return {**item, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


def _all_on_cuda(params: list) -> bool:
    """Whether ``params`` (tensors or param groups) are all floating-point CUDA tensors."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)


@registry.optimizers.register("adamw")
def adamw(
    params: Iterable[torch.Tensor] | Iterable[dict],
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """torch's AdamW (decay scaled by the LR)."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)


@registry.optimizers.register("sgd")
def sgd(
    params: Iterable[torch.Tensor] | Iterable[dict],
    lr: float = 1e-2,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)


def check_hyperparameters(arguments: Mapping[str, Any], key_path: str = "optimizer") -> None:
    """Refuse optimizer values that torch takes silently (NaN) or refuses only once the model is built.

    ``arguments`` are an optimizer section's keys (any registered optimizer; keys it lacks are skipped).
    """
    for key, allowed, example in (
        ("lr", "a finite number >= 0", "6.0e-4"),
        ("eps", "a finite number > 0", "1.0e-8"),
        ("weight_decay", "a finite number >= 0", "0.0"),
        ("momentum", "a finite number >= 0", "0.9"),
    ):
        value = arguments.get(key)
        if value is None:
            continue
        valid = isinstance(value, int | float) and math.isfinite(value) and (value > 0 if key == "eps" else value >= 0)
        if not valid:
            raise ConfigError(f"'{key_path}.{key}' is {value!r}; it must be {allowed}, e.g. {example}.")
    betas = arguments.get("betas")
    if betas is not None:
        pair = list(betas) if isinstance(betas, list | tuple) else None
        if pair is None or len(pair) != 2 or not all(isinstance(b, int | float) and 0 <= b < 1 for b in pair):
            raise ConfigError(
                f"'{key_path}.betas' is {betas!r}; it must be a pair [beta1, beta2], each in [0, 1), e.g. [0.9, 0.95]."
            )
