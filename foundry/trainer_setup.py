"""The Trainer's arguments made into the run's components: seeds, loggers, the placed model, optimizers.

Each function validates what it is given, so ``Trainer.__init__`` reads as the order of construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry import distributed
from foundry.config import FSDPConfig
from foundry.core import LoggerDestination, State, Time
from foundry.distributed.parallelize import init_on_cpu
from foundry.errors import ConfigError
from foundry.models.base import FoundryModel
from foundry.models.lora import trainable_parameters
from foundry.optim.optimizers import DecoupledAdamW
from foundry.optim.schedulers import TimeScheduler


def default_loggers(
    given: Sequence[LoggerDestination],
    run_folder: Path,
    log_to_console: bool,
    progress_bar: bool | None,
    console_log_interval: str | Time | int,
) -> list[LoggerDestination]:
    """The console and ``<run_folder>/metrics.jsonl`` loggers, unless ``given`` already has one of each kind."""
    from foundry.loggers import ConsoleLogger, JSONLLogger

    defaults: list[LoggerDestination] = []
    if log_to_console and not any(isinstance(d, ConsoleLogger) for d in given):
        defaults.append(ConsoleLogger(progress_bar=progress_bar, log_interval=console_log_interval))
    if not any(isinstance(d, JSONLLogger) for d in given):
        defaults.append(JSONLLogger(path=str(run_folder / "metrics.jsonl")))
    return defaults


def place_model(model: FoundryModel, device: torch.device, fsdp_config: FSDPConfig | None, precision: str) -> None:
    """Shard ``model`` onto ``device`` with FSDP2, or move it there (a meta-device model initialised on the CPU)."""
    if fsdp_config is not None:
        distributed.parallelize(model, fsdp_config, device, precision)
    else:
        if any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]):
            init_on_cpu(model)  # the weights a sharded run of the same seed starts from
        model.to(device)


def build_optimizers(optimizers: Any, model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers to step: given, built by a factory from the trainable parameters, or the default."""
    if optimizers is None:
        return [DecoupledAdamW(model.parameters(), lr=3e-4)]
    if callable(optimizers) and not isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers(trainable_parameters(model))]  # frozen weights (LoRA's base) get no optimizer state
    return _as_list(optimizers)


def build_schedulers(schedulers: Any, state: State) -> list[Any]:
    """``schedulers`` (one, several or None) as a list stepped once per batch; ``TimeScheduler``s bound to ``state``."""
    return [_as_torch_scheduler(scheduler, state) for scheduler in _as_list(schedulers)]


def grad_scaler(precision: str, sharded: bool) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; sharded, every rank must agree on skipping a step with inf gradients."""
    if precision != "amp_fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cuda")
    return torch.amp.GradScaler("cuda")


def eval_loaders(eval_dataloader: Iterable | Mapping[str, Iterable] | None) -> dict[str, Iterable]:
    """``{label: loader}`` from one loader (label ``eval``), a mapping, or None."""
    if eval_dataloader is None:
        return {}
    if isinstance(eval_dataloader, Mapping):
        return dict(eval_dataloader)
    return {"eval": eval_dataloader}


def dataloader_len(loader: Iterable | None) -> int | None:
    """Batches per epoch, or None for a loader without a length."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _as_torch_scheduler(scheduler: Any, state: State) -> Any:
    if isinstance(scheduler, TimeScheduler):
        if len(state.optimizers) != 1:
            raise ConfigError("A TimeScheduler needs exactly one optimizer; wrap each optimizer's scheduler yourself.")
        return scheduler.to_torch(state.optimizers[0], state)
    return scheduler


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]
