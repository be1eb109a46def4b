"""L2 norms of gradients, weights and Adam moments: the first curves to read when a run diverges.

``full_norms`` is the one place foundry turns a list of tensors into their norms: one fused pass on
device, FSDP2 shards (DTensor) reduced to the global norm, and no host sync; ``nan_guard`` uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import Time, TimeUnit
from foundry.errors import ConfigError

# Adam state key -> (metric prefix, norm order). ||sqrt(v)||_2 = sqrt(sum(v)) since v >= 0: an L1 norm
# then a square root, with no temporary sqrt(v) tensor.
_MOMENTS = {"exp_avg": ("l2_norm/moment", 2), "exp_avg_sq": ("l2_norm/second_moment_sqrt", 1)}


def full_norms(tensors: Sequence[torch.Tensor], ord: int = 2) -> torch.Tensor:
    """The L1 or L2 norm of each tensor as one float32 vector ``(len(tensors),)`` on device; no host sync.

    A DTensor (an FSDP2 shard) is normed locally and the ``ord``-th powers are summed over the mesh
    dimensions it is sharded on, so the result is the global norm on every rank, with one small
    all-reduce per distinct layout rather than one per tensor.
    """
    if not tensors:
        return torch.zeros(0)
    groups: dict[Any, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(_layout(tensor), []).append(index)
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for layout, indices in groups.items():
        local = [_local(tensors[i]) for i in indices]
        powers = torch.stack(torch._foreach_norm(local, ord, dtype=torch.float32)) ** ord
        if layout is not None:
            mesh, sharded = layout
            placements = [Partial("sum") if is_sharded else Replicate() for is_sharded in sharded]
            powers = DTensor.from_local(powers, mesh, placements).full_tensor()
        for index, value in zip(indices, (powers ** (1.0 / ord)).unbind()):
            norms[index] = value
    return torch.stack(norms)  # type: ignore[arg-type]


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients together (0-d float32, on device; 0 when no parameter has a gradient)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(full_norms(grads))


def grad_norm_of_batch(state: State, grad_norms: torch.Tensor | None = None) -> torch.Tensor:
    """This batch's global grad norm: gradient_clipping's pre-clip norm when it computed one, else computed.

    ``grad_norms`` (every gradient's norm, when the caller has them) saves a second pass over the gradients.
    """
    if state.grad_norm is not None:  # set by gradient_clipping this batch (the Trainer clears it per batch)
        return state.grad_norm.float()
    if grad_norms is not None:
        return torch.linalg.vector_norm(grad_norms)
    return global_grad_norm(state.model.parameters())


def _layout(tensor: torch.Tensor) -> tuple[Any, tuple[bool, ...]] | None:
    if isinstance(tensor, DTensor):
        return tensor.device_mesh, tuple(placement.is_shard() for placement in tensor.placements)
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@registry.callbacks.register("optimizer_monitor")
class OptimizerMonitor(Callback):
    """Logs ``l2_norm/grad/global`` every ``log_interval`` batches, and per-parameter norms (Composer's names).

    With ``log_optimizer_metrics``, also per parameter: ``l2_norm/grad/<name>`` (gradients after any
    clipping), ``l2_norm/param/<name>`` (weights after the step), and for Adam-family optimizers
    ``l2_norm/moment/<name>`` and ``l2_norm/second_moment_sqrt/<name>`` (after the step). The global
    norm is gradient_clipping's pre-clip norm when available. Norms are computed on device in one
    fused pass and read with one host sync per logged batch; under FSDP2 they are global norms.

    Args:
        log_optimizer_metrics: Also log the per-parameter norms.
        log_interval: Every how many batches to log, e.g. '10ba' (each log costs a host sync and,
            with per-parameter metrics, one read of weights, gradients and moments).
    """

    def __init__(self, log_optimizer_metrics: bool = True, log_interval: str | int | Time = "10ba") -> None:
        interval = Time.parse(log_interval)
        if interval.unit != TimeUnit.BATCH or interval.value < 1:
            raise ConfigError(
                f"callbacks.optimizer_monitor.log_interval is '{log_interval}'; give a whole number of batches "
                "such as '10ba'."
            )
        self.log_optimizer_metrics = log_optimizer_metrics
        self.log_interval_batches = int(interval.value)
        self._names: list[str] = []
        self._norms: list[torch.Tensor] = []  # device vectors, read once at BATCH_END

    def before_optimizer_step(self, state: State, logger: Logger) -> None:
        self._names, self._norms = [], []
        if (state.timestamp.batch + 1) % self.log_interval_batches != 0:  # the batch being trained, 1-based
            return
        if not self.log_optimizer_metrics:
            self._add(["l2_norm/grad/global"], grad_norm_of_batch(state).reshape(1))
            return
        named_grads = [(name, p.grad) for name, p in state.model.named_parameters() if p.grad is not None]
        grad_norms = full_norms([grad for _, grad in named_grads])
        self._add(["l2_norm/grad/global"], grad_norm_of_batch(state, grad_norms).reshape(1))
        self._add([f"l2_norm/grad/{name}" for name, _ in named_grads], grad_norms)

    def after_optimizer_step(self, state: State, logger: Logger) -> None:
        if not self._norms or not self.log_optimizer_metrics:
            return
        named_params = [(name, p) for name, p in state.model.named_parameters() if p.requires_grad]
        self._add([f"l2_norm/param/{name}" for name, _ in named_params], full_norms([p for _, p in named_params]))
        names = {p: name for name, p in named_params}
        for key, (prefix, ord) in _MOMENTS.items():
            named_moments = [(names[p], s[key]) for p, s in _optimizer_states(state) if key in s and p in names]
            norms = full_norms([moment for _, moment in named_moments], ord=ord)
            self._add([f"{prefix}/{name}" for name, _ in named_moments], norms.sqrt() if ord == 1 else norms)

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self._norms:
            return
        values = torch.cat([norm.to(self._norms[0].device) for norm in self._norms]).tolist()  # the one sync
        logger.log_metrics(dict(zip(self._names, values)))
        self._names, self._norms = [], []

    def _add(self, names: list[str], norms: torch.Tensor) -> None:
        self._names.extend(names)
        self._norms.append(norms)


def _optimizer_states(state: State) -> Iterable[tuple[torch.Tensor, dict[str, Any]]]:
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param in optimizer.state:
                    yield param, optimizer.state[param]
