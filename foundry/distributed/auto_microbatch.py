"""``device_train_microbatch_size: auto``: the largest microbatch that fits in device memory, on every rank.

On the first batch the Trainer calls ``find_microbatch_size``. It runs the batch's forward and backward
passes as a trial at the device batch size, halving the microbatch after an out-of-memory error
(``torch.OutOfMemoryError``) until a trial fits on every rank. The trial's gradients are discarded and
its random draws undone, so the batch then trains exactly as with that fixed microbatch size.

Ranks must agree, and a rank that runs out of memory must not leave its peers waiting in a collective:

- trials run with gradient sync off, so backward issues no reductions (only all-gathers);
- before every FSDP unit's all-gather, in forward and in backward, each rank joins a small all-reduce
  of ``[ranks out of memory, ranks still in the trial]``; a rank that ran out of memory (or finished)
  joins the same all-reduce in a loop until no rank is still in the trial. A rank that learns of a
  peer's failure stops at that point, so all ranks leave the trial having issued the same collectives.

An out-of-memory error inside FSDP's own all-gather buffer allocation is not covered (the rank would
skip a collective its peers wait in); ``dist_timeout`` then ends the run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from foundry.distributed.env import all_reduce_sum, get_rank, get_world_size
from foundry.distributed.fsdp import set_gradient_sync
from foundry.errors import TrainingError

log = logging.getLogger(__name__)


class _PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory: this rank stops its trial at the same point."""


def find_microbatch_size(
    model: nn.Module, device_batch_size: int, trial: Callable[[int], None], device: torch.device
) -> int:
    """The largest microbatch size (``device_batch_size`` halved until it fits) that every rank can train.

    Args:
        model: the (possibly sharded) model whose gradients ``trial`` fills.
        device_batch_size: samples in this rank's batch; the first size tried.
        trial: runs forward and backward over the batch split into microbatches of the given size.
        device: where the agreement's all-reduce runs.
    """
    size = device_batch_size
    agreement = _Agreement(device)
    with agreement.sync_points(model):
        while True:
            attempt = functools.partial(_trial_without_side_effects, model, trial, size, device)
            out_of_memory = agreement.try_on_every_rank(attempt)
            reset_after_trial(model)
            if not out_of_memory:
                return size
            if size == 1:
                raise TrainingError(
                    "device_train_microbatch_size: auto: even one sample per microbatch runs out of device memory. "
                    "Make the model or max_seq_len smaller, turn on fsdp_config.activation_checkpointing, shard over "
                    "more GPUs, or use fsdp_config.cpu_offload."
                )
            log.info("A microbatch of %d samples ran out of memory on some rank; trying %d.", size, size // 2)
            size //= 2


def _trial_without_side_effects(
    model: nn.Module, trial: Callable[[int], None], size: int, device: torch.device
) -> None:
    set_gradient_sync(model, False)  # a rank that fails mid-backward must not skip a reduction its peers run
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws are undone
        trial(size)


def reset_after_trial(model: nn.Module) -> None:
    """Drop every gradient (also those FSDP2 holds unreduced) and FSDP2's state of an aborted iteration."""
    model.zero_grad(set_to_none=True)
    if not isinstance(model, FSDPModule):
        return
    if hasattr(model, "reset_iter_state"):  # torch >= 2.14
        model.reset_iter_state()
    else:
        _reset_iter_state_before_2_14(model)
    for param_group in _param_groups(model):  # FSDP2 has no public API for unreduced gradients
        for fsdp_param in param_group.fsdp_params:
            fsdp_param.unsharded_accumulated_grad = None
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None


def _param_groups(model: nn.Module) -> Iterator:
    for module in model.modules():
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None:
            yield group


def _reset_iter_state_before_2_14(model: FSDPModule) -> None:
    """What ``FSDPModule.reset_iter_state`` does, for torch versions without it: reshard, forget the iteration."""
    # A private module whose path changes between torch versions: read only on the versions that need it.
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    root_state = model._get_fsdp_state()
    for param_group in _param_groups(model):
        param_group._training_state = TrainingState.IDLE
        param_group._to_sharded()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            state._training_state = TrainingState.IDLE
            if hasattr(state, "_modules_to_run_forward"):
                state._modules_to_run_forward.clear()
    root_state._state_ctx.iter_forward_root = None
    root_state._state_ctx.post_backward_final_callback_queued = False
    root_state._comm_ctx.post_forward_order.clear()


class _Agreement:
    """The all-reduces through which ranks learn that one of them ran out of memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.distributed = get_world_size() > 1

    def try_on_every_rank(self, trial: Callable[[], None]) -> bool:
        """Run ``trial``; whether it ran out of memory on any rank (every rank returns the same answer)."""
        try:
            trial()
            out_of_memory = False
        except (torch.OutOfMemoryError, _PeerOutOfMemory) as exc:
            out_of_memory = True
            if not isinstance(exc, _PeerOutOfMemory):
                log.info("Rank %d ran out of memory: %s", get_rank(), str(exc).split("\n")[0])
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.distributed:
            return out_of_memory
        while True:  # until every rank has left its trial
            ranks_out_of_memory, ranks_in_trial = self._counts(out_of_memory, in_trial=False)
            if ranks_in_trial == 0:
                return ranks_out_of_memory > 0

    def sync_point(self) -> None:
        """Called before each FSDP all-gather of a trial: stop here if a peer ran out of memory."""
        ranks_out_of_memory, _ = self._counts(False, in_trial=True)
        if ranks_out_of_memory:
            raise _PeerOutOfMemory("another rank ran out of memory")

    def _counts(self, out_of_memory: bool, in_trial: bool) -> tuple[int, int]:
        counts = torch.tensor([float(out_of_memory), float(in_trial)], device=self.device)
        ranks_out_of_memory, ranks_in_trial = all_reduce_sum(counts).tolist()
        return int(ranks_out_of_memory), int(ranks_in_trial)

    @contextlib.contextmanager
    def sync_points(self, model: nn.Module) -> Iterator[None]:
        """Hooks that call ``sync_point`` before each FSDP unit's forward and backward (several ranks only)."""
        handles: list[RemovableHandle] = []
        if self.distributed:
            for module in model.modules():
                if not isinstance(module, FSDPModule):
                    continue
                # prepend: before FSDP's own pre-forward hook, which all-gathers the unit's parameters
                handles.append(module.register_forward_pre_hook(lambda *_: self.sync_point(), prepend=True))
                if module is not model:  # the root keeps its parameters gathered for backward
                    handles.append(module.register_forward_hook(self._sync_before_backward))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _sync_before_backward(self, module: nn.Module, args: tuple, output: object) -> object:
        # Runs after FSDP's post-forward hook, which registered the unit's backward all-gather on
        # ``output``: the gradient reaches our node first, so the sync point precedes that all-gather.
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _SyncInBackward.apply(self.sync_point, output)
        return output


class _SyncInBackward(torch.autograd.Function):
    """Identity in forward; calls ``sync`` when the gradient passes in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, sync: Callable[[], None], tensor: torch.Tensor):
        ctx.sync = sync
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        ctx.sync()
        return None, grad
