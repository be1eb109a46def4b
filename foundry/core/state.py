"""Everything a callback may read and an algorithm may change about a run, in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from foundry.core.parallel_dims import ParallelDims
from foundry.core.time import Time, Timestamp, TimeUnit


@dataclasses.dataclass
class State:
    """The run as it is now.

    Callbacks read it; algorithms may change it (swap a module, scale a loss). The Trainer is
    the only writer of ``timestamp``.
    """

    model: torch.nn.Module
    max_duration: Time
    run_name: str = "foundry-run"
    run_folder: str | None = None  # where the run's metrics, plots and logger files go
    optimizers: list[torch.optim.Optimizer] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    train_dataloader: Iterable | None = None
    eval_dataloaders: dict[str, Iterable] = dataclasses.field(default_factory=dict)
    timestamp: Timestamp = dataclasses.field(default_factory=Timestamp)
    precision: str = "fp32"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # How the ranks divide the work (degrees of each axis), and the mesh built from it once the model is placed
    # (None on one rank): loaders, loss and metric reductions and throughput ask these, not the world.
    parallel_dims: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    mesh: Any = None  # foundry.distributed.mesh.JobMesh
    seed: int = 17
    device_train_microbatch_size: int | None = None
    train_dataloader_len: int | None = None  # batches per epoch, when the loader knows it
    tokenizer: Any = None  # the model's tokenizer, when the run knows it (checkpoints name it)

    # Per-batch values, set by the loop as it goes.
    batch: Any = None
    microbatch: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None  # the batch's total loss (detached, on device); no host sync
    batch_num_samples: int = 0
    batch_num_tokens: int = 0

    # Eval results by dataloader label, e.g. {"eval": {"loss": 3.1, "perplexity": 22.2}}.
    eval_metrics: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # Set at BEFORE_OPTIMIZER_STEP to drop this batch's update (e.g. a NaN gradient); reset every batch.
    skip_optimizer_step: bool = False
    # This batch's global pre-clip gradient norm (device tensor) when an algorithm computed it (gradient
    # clipping), so monitors reuse it instead of another pass over the gradients; reset every batch.
    grad_norm: torch.Tensor | None = None
    # Set by a callback to end fit() after the current batch; the reason is logged.
    stop_reason: str | None = None
    # Path of the newest checkpoint this run wrote or loaded.
    last_checkpoint_path: str | None = None
    # Extra flops a batch costs beyond the model's forward+backward (e.g. recompute), for HFU.
    extra_flops_per_batch: int = 0

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def progress(self) -> float:
        """Fraction of ``max_duration`` done, in [0, 1] (the basis of ``dur`` units)."""
        unit = self.max_duration.unit
        if self.max_duration.value == 0:
            return 1.0
        if unit == TimeUnit.EPOCH:
            done = float(self.timestamp.epoch)
            if self.train_dataloader_len:
                done += self.timestamp.batch_in_epoch / self.train_dataloader_len
            return min(done / self.max_duration.value, 1.0)
        return min(self.timestamp.get(unit) / self.max_duration.value, 1.0)

    def to_absolute(self, time: Time) -> Time:
        """Turn a ``dur`` time into the unit of ``max_duration``; other times pass through."""
        if time.unit != TimeUnit.DURATION:
            return time
        value = time.value * self.max_duration.value
        return Time(round(value), self.max_duration.unit)

    def reached(self, time: Time) -> bool:
        """Whether the run has trained for at least ``time``."""
        if time.unit == TimeUnit.DURATION:
            return self.progress >= time.value
        if time.unit == TimeUnit.EPOCH and self.train_dataloader_len:
            return self.timestamp.epoch + self.timestamp.batch_in_epoch / self.train_dataloader_len >= time.value
        return self.timestamp.get(time.unit) >= time.value

    def crossed_multiple(self, interval: Time, previous: Timestamp) -> bool:
        """Whether the last step moved the run past a multiple of ``interval`` (for eval/save cadence).

        Epoch intervals are answered at epoch boundaries; every other unit after each batch.
        """
        interval = self.to_absolute(interval)
        if interval.value <= 0:
            return False
        before, now = previous.get(interval.unit), self.timestamp.get(interval.unit)
        return now // interval.value > before // interval.value

    @property
    def lrs(self) -> list[float]:
        """Current learning rate of every param group of every optimizer."""
        return [group["lr"] for optimizer in self.optimizers for group in optimizer.param_groups]
