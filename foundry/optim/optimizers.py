"""Optimizers by YAML name: ``decoupled_adamw`` (LLM Foundry's default for pretraining), ``decoupled_lionw``, ..."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from foundry import registry
from foundry.errors import ConfigError

MomentsDtype = Literal["float32", "bfloat16"]  # how Adam's two moments are stored


@registry.optimizers.register("decoupled_adamw")
class DecoupledAdamW(torch.optim.AdamW):
    """AdamW whose weight decay follows the LR schedule but not the LR's magnitude.

    torch's AdamW shrinks weights by ``lr * weight_decay`` per step, so retuning ``lr`` silently
    retunes decay. Here the shrink is ``weight_decay * lr / initial_lr``: ``weight_decay`` means the
    same thing at any peak LR (Loshchilov & Hutter's decoupling, as Composer's DecoupledAdamW does).
    The Adam update itself is torch's; ``fused=None`` picks the fused kernel when every parameter is
    on a CUDA device (torch itself would pick the slower foreach one). ``moments_dtype: bfloat16``
    stores both moments in bf16 (see ``adam_step_with_bf16_moments``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        fused: bool | None = None,
        moments_dtype: MomentsDtype = "float32",
    ) -> None:
        params = [_listed(item) for item in params]
        self.bf16_moments = _bf16_moments(moments_dtype, fused)
        if fused is None:
            fused = _all_on_cuda(params) and not self.bf16_moments
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
        if self.bf16_moments:
            return adam_step_with_bf16_moments(self, closure)
        return super().step(closure)


class AdamWWithBF16Moments(torch.optim.AdamW):
    """torch's AdamW (decay scaled by the LR) with both moments stored in bf16."""

    @torch.no_grad()
    def step(self, closure=None):
        return adam_step_with_bf16_moments(self, closure)


def adam_step_with_bf16_moments(optimizer: torch.optim.AdamW, closure: Any = None) -> Any:
    """One AdamW step (torch's math, its state keys) whose ``exp_avg`` and ``exp_avg_sq`` are kept in bf16.

    Each parameter's moments are widened to fp32, updated and used there, and rounded back to bf16:
    the update of a step is computed in fp32 and only what carries over to the next step is rounded.
    The moments then take 4 bytes per parameter instead of 8 (16 GB less for an 8B model, summed over
    ranks). The parameters stay fp32. Sharded parameters (FSDP2's DTensors) are stepped on their local
    shards; the state stays a DTensor, so checkpoints reshard as usual.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
            for key in ("exp_avg", "exp_avg_sq"):  # load_state_dict casts state to the parameter's dtype
                if state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)
            state["step"] += 1
            step = state["step"].item()
            weight, grad, exp_avg, exp_avg_sq = (
                _local(tensor) for tensor in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
            )
            grad = grad.float()
            exp_avg_fp32 = exp_avg.float().lerp_(grad, 1 - beta1)
            exp_avg_sq_fp32 = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            exp_avg.copy_(exp_avg_fp32)
            exp_avg_sq.copy_(exp_avg_sq_fp32)
            if weight_decay:
                weight.mul_(1 - lr * weight_decay)
            denominator = exp_avg_sq_fp32.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
            weight.addcdiv_(exp_avg_fp32, denominator, value=-lr / (1 - beta1**step))
    return loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bf16_moments(moments_dtype: str, fused: bool | None) -> bool:
    """Whether the moments are stored in bf16; refuses ``fused: true`` with them, which no kernel here serves.

    torch's fused AdamW keeps the moments in the parameters' dtype, so bf16 moments take the unfused step of
    ``adam_step_with_bf16_moments``; a ``fused: true`` beside them would be silently ignored.
    """
    if moments_dtype not in ("float32", "bfloat16"):
        raise ConfigError(
            f"'optimizer.moments_dtype' is {moments_dtype!r}; use 'float32' (the default) or 'bfloat16' (half the "
            "optimizer state's memory)."
        )
    if moments_dtype == "bfloat16" and fused:
        raise ConfigError(
            "'optimizer.fused' is true and 'optimizer.moments_dtype' is 'bfloat16': torch's fused AdamW kernel keeps "
            "the moments in the parameters' dtype, so the bf16 moments run on foundry's unfused step and the fused "
            "kernel would not be used. Remove 'optimizer.fused' (or set it to false) to keep bf16 moments, or drop "
            "'optimizer.moments_dtype' to use the fused kernel with fp32 moments."
        )
    return moments_dtype == "bfloat16"


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
    moments_dtype: MomentsDtype = "float32",
) -> torch.optim.AdamW:
    """torch's AdamW (decay scaled by the LR); ``moments_dtype: bfloat16`` keeps both moments in bf16."""
    if _bf16_moments(moments_dtype, fused):
        return AdamWWithBF16Moments(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
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
