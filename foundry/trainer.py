"""The training loop. Features live in callbacks, algorithms and components; this file stays short.

Read ``foundry.core.event`` for where each event fires. Example::

    trainer = Trainer(model=model, train_dataloader=loader, max_duration="100ba",
                      optimizers=DecoupledAdamW(model.parameters(), lr=6e-4),
                      schedulers=CosineWithWarmupScheduler(t_warmup="10ba", alpha_f=0.1))
    trainer.fit()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from foundry import distributed
from foundry.algorithms.torch_compile import compile_algorithm
from foundry.batches import RepeatedSampleMask, batch_num_samples, batch_num_tokens, batch_to_device, split_batch
from foundry.checkpoint.config import CheckpointConfig
from foundry.checkpoint.preemption import Preemption, preemption_of
from foundry.checkpoint.saver import Checkpointer
from foundry.core import (
    Algorithm,
    Callback,
    Engine,
    Event,
    Interval,
    Logger,
    LoggerDestination,
    State,
    Time,
    seed_everything,
)
from foundry.core.cuda_allocator import apply_allocator_settings
from foundry.core.parallel_dims import ParallelDims
from foundry.core.precision import autocast, check_precision, compute_dtype, grad_scaler
from foundry.core.time import positive_time
from foundry.distributed.config import FSDPConfig, ParallelismConfig
from foundry.distributed.fsdp import GradientAccumulation
from foundry.distributed.placement import job_layout, place_model
from foundry.distributed.tensor_parallel import check_same_batch
from foundry.errors import ConfigError, TrainingError
from foundry.eval.config import EvalConfig
from foundry.eval.during_training import build_icl_evaluation
from foundry.kernels.weight_grad import WeightGradSums, accumulate_weight_grads_in_place
from foundry.loggers import default_loggers
from foundry.loggers.config import ConsoleConfig
from foundry.models.base import FoundryModel, ModuleModel
from foundry.models.objective import Objective
from foundry.optim import build_optimizers, build_schedulers
from foundry.optim.schedulers import TimeScheduler
from foundry.run_config import TRAINER_SECTIONS, RunConfig
from foundry.schema import parse_dataclass, split_settings

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Trainer:
    """Coordinates a model, data, optimizers, algorithms, callbacks and loggers through ``fit()``.

    The run's settings are keywords named as LLM Foundry's top-level YAML keys, each owned by one
    section (its dataclass holds the default, type and range): ``RunConfig`` (``precision``,
    ``device``, ``device_train_microbatch_size``, ``compile_config``, ``seed``, ``run_name``...),
    ``CheckpointConfig`` (``save_folder``, ``save_interval``, ``autoresume``...), ``EvalConfig``
    (``eval_interval``, ``icl_tasks``...) and ``ConsoleConfig``. ``foundry train`` passes a YAML's
    values for the same keys, so ``Trainer(...)`` and ``foundry train`` apply the same defaults and
    the same features (compile, ICL evaluation, the allocator setting); ``foundry train --help``
    lists every key. A ``save_folder`` is locked for this run until ``fit()`` ends
    (``foundry.checkpoint.lock``); on SIGTERM or SIGUSR1 ``fit()`` checkpoints the batch reached and
    returns with ``state.stop_reason`` saying so (``foundry.checkpoint.preemption``).

    Args:
        model: a ``FoundryModel``, or any ``nn.Module`` whose forward returns a loss. A registered model
            (``foundry.registry.models``) is stored in checkpoints by name and config, so that
            ``foundry.load_model``, ``foundry eval`` and ``foundry convert`` reopen them.
        train_dataloader: yields this device's whole batches (global batch / world size).
        max_duration: how long ``fit()`` trains: ``"100ba"``, ``"2ep"``, ``"1000000tok"``... (default ``1ep``).
        optimizers: an optimizer, or a function ``params -> optimizer`` (built after the model is on its
            device, so sharding and surgery happen first). Default: ``DecoupledAdamW(lr=3e-4)``.
        schedulers: ``TimeScheduler``s (or torch LR schedulers) stepped once per batch.
        eval_dataloader: one loader or ``{label: loader}``, evaluated every ``eval_interval`` and at the end.
        callbacks / algorithms / loggers: what observes the run, what changes it, where metrics go.
        tokenizer: the model's tokenizer, stored in checkpoints by name and used by ``icl_tasks``
            (default: the train dataloader's ``tokenizer``, if it has one).
        fsdp_config: an ``FSDPConfig`` (or its keys): shard the model with FSDP2 over several ranks. On one
            rank FSDP is skipped (it would only add copies) but its activation checkpointing and mixed
            precision still apply. Without it a single process trains the plain module and several ranks
            replicate it (``NO_SHARD``, DDP's layout). See ``foundry.distributed.fsdp``.
        parallelism: a ``ParallelismConfig`` (or its keys), e.g. ``{"context_parallel_degree": 2}``: ranks
            that split each sequence along its length (``foundry.distributed.context_parallel``).
        objective: what each step minimises (``foundry.models.objective``); default: the model's own loss.
            ``foundry.preference.PreferenceObjective`` trains DPO and its variants.
        config: the resolved YAML of a ``foundry train`` run, stored in checkpoints and sent to loggers.
        checkpointer: the checkpoint section already checked, as a ``Checkpointer`` (``foundry train`` builds
            it before the model, so a refused save_folder fails first); then no ``CheckpointConfig`` key may
            be given. Default: one built from the keywords.
        **settings: any key of the sections above.
    """

    _tp_batches_checked = False  # whether the tensor-parallel ranks' first batches were compared (check_same_batch)

    def __init__(
        self,
        model: FoundryModel | nn.Module,
        train_dataloader: Iterable | None = None,
        max_duration: str | Time | int | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | OptimizerFactory | None = None,
        schedulers: TimeScheduler | Sequence[Any] | None = None,
        eval_dataloader: Iterable | Mapping[str, Iterable] | None = None,
        callbacks: Sequence[Callback] = (),
        algorithms: Sequence[Algorithm] = (),
        loggers: Sequence[LoggerDestination] = (),
        *,
        tokenizer: Any = None,
        fsdp_config: FSDPConfig | Mapping[str, Any] | None = None,
        parallelism: ParallelismConfig | Mapping[str, Any] | None = None,
        objective: Objective | None = None,
        config: dict[str, Any] | None = None,
        checkpointer: Checkpointer | None = None,
        **settings: Any,
    ) -> None:
        run, evaluation, console, self.checkpoints = _sections(settings, checkpointer)
        self.settings = (run, self.checkpoints.config, evaluation, console)
        seed_everything(run.seed)
        apply_allocator_settings(run.expandable_segments)
        fsdp_config = distributed.prepare_sharding(fsdp_config, optimizers)
        parallelism = parse_dataclass(ParallelismConfig, parallelism, "parallelism")
        parallelism, dims = job_layout(fsdp_config, parallelism)  # the job's layout, kept on the State
        device = torch.device(run.device) if run.device is not None else distributed.default_device()
        self._find_microbatch_size = run.device_train_microbatch_size == "auto"
        model = model if isinstance(model, FoundryModel) else ModuleModel(model)
        self.run_folder = Path(run.run_folder_path())
        tokenizer = tokenizer if tokenizer is not None else _loader_tokenizer(train_dataloader)
        self.state = _new_state(run, model, device, max_duration, train_dataloader, eval_dataloader, tokenizer, dims)
        sharded = self.state.world_size > 1 or (fsdp_config is not None and distributed.shards(fsdp_config, device))
        algorithms = [*algorithms, *compile_algorithm(run.compile_config, algorithms, device, sharded)]
        defaults = default_loggers(
            loggers, self.run_folder, console.log_to_console, console.progress_bar, console.console_log_interval
        )
        self.logger = Logger(self.state, [*loggers, *defaults])
        self.engine = Engine(self.state, self.logger, algorithms, [*callbacks, Preemption()])
        self.eval_interval = Interval(evaluation.eval_interval)
        self.eval_first = evaluation.eval_first
        self.eval_subset_num_batches = evaluation.eval_subset_num_batches
        self.icl = build_icl_evaluation(evaluation, self.state.tokenizer, model, dims.tp)
        self.log_interval = Interval(console.console_log_interval)
        self.checkpoints.start(self.engine, config)
        self.config = config
        self._last_eval_batch: int | None = None

        self.objective = objective or Objective()
        self.objective.attach(model)  # before INIT: a copy of the model takes no algorithm's surgery
        self.engine.run_event(Event.INIT)  # before sharding, so that algorithms' model surgery is sharded too
        self._place_model(model, device, fsdp_config, parallelism, run)
        self.state.optimizers = build_optimizers(optimizers, self.state.model)
        self.state.schedulers = build_schedulers(schedulers, self.state)
        if config is not None:
            self.logger.log_hyperparameters(config)
        self.checkpoints.resume()
        self.objective.after_load(self.state, self.checkpoints.load_path)
        self.engine.run_event(Event.AFTER_LOAD)

    def _place_model(
        self,
        model: FoundryModel,
        device: torch.device,
        fsdp_config: Any,
        parallelism: ParallelismConfig,
        run: RunConfig,
    ) -> None:
        """Move (and shard) the model onto its device, and choose how gradients accumulate and are scaled."""
        dims = self.state.parallel_dims
        placement = place_model(model, device, fsdp_config, self.state.precision, parallelism, dims)
        for module in self.objective.modules_to_place():  # placed as the model is: a frozen reference model
            place_model(module, device, fsdp_config, self.state.precision, parallelism, dims)
        self._accumulation, self._batches = placement.accumulation, placement.batches
        self.state.mesh = placement.mesh
        if self._accumulation is None and isinstance(model, FSDPModule):  # sharded by the caller: FSDP2's own schedule
            fsdp2_schedule = FSDPConfig(reduce_every_microbatch=False, reshard_between_microbatches=True)
            self._accumulation = GradientAccumulation(model, [], fsdp2_schedule)
        # Unsharded, each linear sums its weight gradient inside the GEMM (FSDP2 owns a sharded model's).
        fuse = run.fuse_weight_grad_accumulation and not isinstance(model, FSDPModule)
        self._weight_grad_sums: WeightGradSums | None = accumulate_weight_grads_in_place(model) if fuse else None
        self._grad_scaler = grad_scaler(run.precision, sharded=isinstance(model, FSDPModule))

    @property
    def _loss_group(self) -> Any:
        """The ranks a batch's loss and metrics are summed over (None: every rank)."""
        return self.state.mesh.loss_group if self.state.mesh is not None else None

    @property
    def save_folder(self) -> str | None:
        """Where the run's checkpoints go (``{run_name}`` filled in), or None."""
        return self.checkpoints.save_folder

    # ------------------------------------------------------------------------------------- fit
    def fit(self) -> None:
        """Train until ``max_duration`` (or a callback sets ``state.stop_reason``)."""
        state = self.state
        if state.train_dataloader is None:
            raise ConfigError("Trainer.fit() needs a train_dataloader.")
        checkpoints = f"; checkpoints in {self.save_folder}" if self.save_folder else ""
        self.logger.log_text(f"foundry: run '{state.run_name}': metrics in {self.run_folder}{checkpoints}")
        if self._batches.summary:  # how the ranks split the batches, when it is news (context parallelism)
            self.logger.log_text(f"foundry: {self._batches.summary}")
        try:
            self.engine.run_event(Event.FIT_START)
            if self.eval_first and state.timestamp.batch == 0:
                self.eval()
            while not self._finished():
                self._train_epoch()
            self._at_fit_end()
            self.engine.run_event(Event.FIT_END)
        except BaseException:
            self.checkpoints.settle_after_error()
            raise
        finally:
            if self._weight_grad_sums is not None:  # the model trains as plain nn.Linear layers outside fit()
                self._weight_grad_sums.release()
            self.logger.flush()  # queued metrics reach the loggers before they close
            self.checkpoints.release_lock()  # another run may use the save_folder now
            self.engine.close()

    def _finished(self) -> bool:
        return self.state.reached(self.state.max_duration) or self.state.stop_reason is not None

    def _train_epoch(self) -> None:
        state = self.state
        self.engine.run_event(Event.EPOCH_START)
        batches = self._epoch_batches()
        epoch_done = False
        while True:
            batch_start_s = time.perf_counter()
            self.engine.run_event(Event.BEFORE_DATALOADER)
            batch = next(batches, None)
            if batch is None:
                epoch_done = True
                break
            state.batch = batch_to_device(batch, state.device)
            if state.parallel_dims.tp > 1 and not self._tp_batches_checked:  # the first batch: a loader ignoring tp
                check_same_batch(state.batch, state.mesh["tp"].get_group(), state.parallel_dims.tp)
                self._tp_batches_checked = True
            self.engine.run_event(Event.AFTER_DATALOADER)
            self._train_batch(batch_start_s)
            if self._finished():
                epoch_done = state.timestamp.batch_in_epoch == state.train_dataloader_len
                break
        if state.timestamp.batch_in_epoch == 0 and epoch_done:
            raise TrainingError("The train dataloader yielded no batches; check the dataset split and batch size.")
        if epoch_done:
            previous = state.timestamp
            state.timestamp = previous.after_epoch()
            self.logger.flush()  # epoch-unit console intervals print at EPOCH_END with the epoch's last loss
            self.engine.run_event(Event.EPOCH_END)
            self.checkpoints.after_epoch(since=previous)
            if self.eval_interval.due(state, epoch_end=True, since=previous) and not self._finished():
                self.eval()

    def _epoch_batches(self) -> Iterator[Any]:
        """This epoch's batches; a resumed run skips the ones already trained unless the loader restores itself."""
        loader = self.state.train_dataloader
        iterator = iter(loader)
        restores_itself = hasattr(loader, "load_state_dict")
        if not restores_itself:
            for _ in range(self.state.timestamp.batch_in_epoch):
                next(iterator, None)
        return iterator

    def _train_batch(self, batch_start_s: float) -> None:
        state, engine = self.state, self.engine
        engine.run_event(Event.BATCH_START)
        self._start_batch_sums()
        if self._weight_grad_sums is not None:  # the optimizer (or a load, or BATCH_START) moved the weights
            self._weight_grad_sums.start_batch()
        if self._find_microbatch_size:
            self._choose_microbatch_size()
        microbatches = split_batch(self._batches.shard(state.batch), state.device_train_microbatch_size)
        weights = [self.objective.loss_weight(state.model, mb) for mb in microbatches]
        # Sum of loss units over all microbatches on all ranks: each microbatch's mean loss is scaled
        # by its share, so gradients equal those of one big batch however it is split.
        local_weight = torch.as_tensor(sum(weights), dtype=torch.float32, device=state.device)
        total_weight = distributed.all_reduce_sum(local_weight.clone(), self._loss_group)
        # FSDP averages gradients over the ranks that hold a share of the loss: each scaled up by as many
        loss_ranks = state.parallel_dims.loss_ranks
        share_of_global_loss = torch.zeros((), device=state.device)
        for index, (microbatch, weight) in enumerate(zip(microbatches, weights)):
            if self._accumulation is not None:  # a sharded model: when to reduce gradients and reshard
                self._accumulation.before_microbatch(last=index == len(microbatches) - 1)
            share_of_global_loss += self._train_microbatch(microbatch, weight * loss_ranks / total_weight)
        share_of_global_loss /= loss_ranks
        state.loss = share_of_global_loss * total_weight / local_weight  # this rank's mean loss
        state.skip_optimizer_step, state.grad_norm = False, None
        if self._grad_scaler:  # algorithms (clipping) see the true gradients, not fp16-scaled ones
            for optimizer in state.optimizers:
                self._grad_scaler.unscale_(optimizer)
        engine.run_event(Event.BEFORE_OPTIMIZER_STEP)
        self._optimizer_step(skip=state.skip_optimizer_step)
        engine.run_event(Event.AFTER_OPTIMIZER_STEP)

        for scheduler in state.schedulers:  # before the timestamp counts this batch, as Composer: batch k+1 at LR(k)
            scheduler.step()
        previous = state.timestamp
        sample_ranks = state.parallel_dims.sample_ranks  # each loaded a batch of its own
        state.batch_num_samples = batch_num_samples(state.batch) * sample_ranks
        state.batch_num_tokens = batch_num_tokens(state.batch) * sample_ranks
        state.timestamp = previous.after_batch(
            state.batch_num_samples, state.batch_num_tokens, time.perf_counter() - batch_start_s
        )
        engine.run_event(Event.BATCH_END)
        # Every batch's loss reaches the loggers; as a device tensor it waits in the Logger's queue
        # (no host sync) until the flush at the console interval converts the queue at once.
        global_loss, correct, loss_terms = self._summed_over_ranks(share_of_global_loss)
        # trainer/tokens: the run's tokens so far, so runs of other batch or world sizes compare (foundry compare)
        metrics = {"loss/train/total": global_loss, "trainer/tokens": state.timestamp.token}
        llm_foundry_metrics = self.objective.llm_foundry_metrics(state.model, global_loss, correct, total_weight)
        for name, value in llm_foundry_metrics.items():
            metrics[f"metrics/train/{name}"] = value  # LLM Foundry's names (docs/LOGGING.md)
        self.logger.log_metrics({**metrics, **loss_terms})
        if self.log_interval.due(state, since=previous) or self._finished():
            self.logger.flush()
        self.checkpoints.after_batch(since=previous)
        if self.eval_interval.due(state, since=previous) and not self._finished():
            self.eval()

    def _start_batch_sums(self) -> None:
        """Empty what ``_train_microbatch`` sums over a batch's microbatches: at each batch's start, and after the
        trial microbatches of ``device_train_microbatch_size: auto``, whose sums must not reach the batch's."""
        self._correct_predictions: torch.Tensor | None = None  # loss units the argmax predicts
        self._loss_term_shares: dict[str, torch.Tensor] = {}  # objective.logged_terms(), each as the loss's share

    def _train_microbatch(self, microbatch: Any, scale: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns its loss's share of the batch loss."""
        state, engine = self.state, self.engine
        state.microbatch = microbatch
        if self._weight_grad_sums is not None:
            self._weight_grad_sums.prepare(compute_dtype(state.precision))
        with self._batches.activated():  # backward too: activation checkpointing recomputes forwards there
            engine.run_event(Event.BEFORE_FORWARD)
            with autocast(state.precision, state.device):
                state.outputs = self.objective.forward(state.model, microbatch)
            engine.run_event(Event.AFTER_FORWARD)
            engine.run_event(Event.BEFORE_LOSS)
            with autocast(state.precision, state.device):
                state.loss = self.objective.loss(state.model, state.outputs, microbatch)
            engine.run_event(Event.AFTER_LOSS)
            correct = self.objective.correct_predictions(state.model, state.outputs, microbatch)
            if correct is not None:
                previous = self._correct_predictions
                self._correct_predictions = correct if previous is None else previous + correct
            loss = state.loss * scale
            for name, term in self.objective.logged_terms(state.model).items():
                self._loss_term_shares[name] = self._loss_term_shares.get(name, 0.0) + term.float() * scale
            engine.run_event(Event.BEFORE_BACKWARD)
            (self._grad_scaler.scale(loss) if self._grad_scaler else loss).backward()
            engine.run_event(Event.AFTER_BACKWARD)
        state.outputs = None  # free activations' outputs (logits) before the next microbatch
        return loss.detach()

    def _summed_over_ranks(
        self, share_of_global_loss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """The batch's loss, correct predictions (None if the model counts none) and each logged term of the
        objective (its mean over all ranks, as the total's), summed over ranks in one all-reduce."""
        correct = self._correct_predictions
        names = sorted(self._loss_term_shares)
        shares = [share_of_global_loss, *([correct] if correct is not None else [])]
        if names:
            shares.append(torch.stack([self._loss_term_shares[name] for name in names]))
        summed = distributed.all_reduce_sums(shares, self._loss_group)
        global_loss, correct = summed[0], summed[1] if correct is not None else None
        means = summed[-1] / self.state.parallel_dims.loss_ranks if names else []
        return global_loss, correct, dict(zip(names, means))

    def _choose_microbatch_size(self) -> None:
        """``device_train_microbatch_size: auto``: trial runs on this first batch pick the size for the run."""
        state = self.state
        batch = self._batches.shard(state.batch)

        def trial(microbatch_size: int) -> None:
            try:
                for microbatch in split_batch(batch, microbatch_size):
                    self._train_microbatch(microbatch, torch.ones((), device=state.device))
            finally:
                state.outputs = state.loss = None  # a failed trial's memory is freed
                self._start_batch_sums()

        size = distributed.find_microbatch_size(state.model, batch_num_samples(batch), trial, state.device)
        state.device_train_microbatch_size = size
        self._find_microbatch_size = False
        self.logger.log_text(f"device_train_microbatch_size: auto chose {size} samples per microbatch.")
        self.logger.log_metrics({"trainer/device_train_microbatch_size": size})

    def _optimizer_step(self, skip: bool) -> None:
        """Step every optimizer (unless ``skip``: the batch's gradients are dropped) and clear the grads."""
        for optimizer in self.state.optimizers:
            if not skip:
                self._grad_scaler.step(optimizer) if self._grad_scaler else optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self._grad_scaler:  # also after a skipped step: unscale_ must be followed by update()
            self._grad_scaler.update()

    # ------------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def eval(self) -> dict[str, dict[str, float]]:
        """Evaluate every eval loader, then the ICL tasks; returns and logs ``{label: {metric: value}}``."""
        state, engine = self.state, self.engine
        self.logger.flush()  # train metrics come out before the eval lines
        state.model.eval()
        for label, loader in state.eval_dataloaders.items():
            engine.run_event(Event.EVAL_START)
            loss_sum = torch.zeros((), dtype=torch.float64, device=state.device)
            weight_sum = torch.zeros((), dtype=torch.float64, device=state.device)
            correct_sum: torch.Tensor | None = None
            count_once = RepeatedSampleMask(self._loss_group)  # samples the ranks' shares repeat count once
            for index, batch in enumerate(loader):
                if 0 <= self.eval_subset_num_batches <= index:
                    break
                state.batch = batch_to_device(count_once(batch), state.device)
                engine.run_event(Event.EVAL_BATCH_START)
                engine.run_event(Event.EVAL_BEFORE_FORWARD)
                pieces = self._batches.shard(state.batch)  # this rank's part of each sequence
                with self._batches.activated(), autocast(state.precision, state.device):
                    state.outputs = self.objective.forward(state.model, pieces)
                    loss = self.objective.loss(state.model, state.outputs, pieces)
                engine.run_event(Event.EVAL_AFTER_FORWARD)
                weight = self.objective.loss_weight(state.model, pieces)
                # A batch of repeated samples only has no weight (and a NaN mean loss): it adds nothing.
                loss_sum += torch.where(torch.as_tensor(weight) > 0, loss.double() * weight, 0.0)
                weight_sum += weight
                correct = self.objective.correct_predictions(state.model, state.outputs, pieces)
                if correct is not None:
                    correct_sum = correct if correct_sum is None else correct_sum + correct
                engine.run_event(Event.EVAL_BATCH_END)
            distributed.all_reduce_sum(loss_sum, self._loss_group)
            distributed.all_reduce_sum(weight_sum, self._loss_group)
            if correct_sum is not None:
                distributed.all_reduce_sum(correct_sum, self._loss_group)
            if weight_sum.item() == 0:
                raise TrainingError(f"Eval loader '{label}' yielded no batches; check its split and batch size.")
            mean_loss = loss_sum / weight_sum
            state.eval_metrics[label] = self.objective.eval_metrics_from_loss(state.model, mean_loss.item())
            llm_foundry = self.objective.llm_foundry_metrics(state.model, mean_loss, correct_sum, weight_sum)
            state.eval_metrics[label].update({name: float(value) for name, value in llm_foundry.items()})
            self.logger.log_metrics({f"metrics/{label}/{k}": v for k, v in state.eval_metrics[label].items()})
            engine.run_event(Event.EVAL_END)
        if self.icl is not None:
            self.icl.run(state, self.logger)
        state.outputs = None
        state.model.train()
        self._last_eval_batch = state.timestamp.batch
        return dict(state.eval_metrics)

    def _at_fit_end(self) -> None:
        """Evaluate and checkpoint the final model unless the last batch already did."""
        state = self.state
        preempted = preemption_of(self.engine.callbacks) is not None  # the grace period is for the checkpoint
        if (state.eval_dataloaders or self.icl) and self._last_eval_batch != state.timestamp.batch and not preempted:
            self.eval()
        self.checkpoints.at_fit_end()


def _sections(
    settings: dict[str, Any], checkpointer: Checkpointer | None
) -> tuple[RunConfig, EvalConfig, ConsoleConfig, Checkpointer]:
    """The Trainer's sections from its keywords; the checkpoint section comes whole as ``checkpointer``, or from
    the keywords (never both)."""
    if isinstance(settings.get("device"), torch.device):
        settings["device"] = str(settings["device"])
    run, checkpointing, evaluation, console = split_settings(settings, TRAINER_SECTIONS, "Trainer")
    if checkpointer is None:
        return run, evaluation, console, Checkpointer(checkpointing, run.run_name)
    if given := sorted(set(settings) & {field.name for field in dataclasses.fields(CheckpointConfig)}):
        raise ConfigError(
            f"Trainer got a checkpointer and checkpoint settings ({', '.join(given)}); set them on the "
            "checkpointer's CheckpointConfig, or pass the settings alone."
        )
    return run, evaluation, console, checkpointer


def _new_state(
    run: RunConfig,
    model: FoundryModel,
    device: torch.device,
    max_duration: str | Time | int | None,
    train_dataloader: Iterable | None,
    eval_dataloader: Iterable | Mapping[str, Iterable] | None,
    tokenizer: Any,
    parallel_dims: ParallelDims,
) -> State:
    """The run's state before its first batch, on this rank."""
    return State(
        model=model,
        max_duration=positive_time(max_duration if max_duration is not None else "1ep", "max_duration"),
        run_name=run.run_name,
        run_folder=run.run_folder_path(),
        train_dataloader=train_dataloader,
        eval_dataloaders=_eval_loaders(eval_dataloader),
        precision=check_precision(run.precision, device),
        device=device,
        rank=distributed.get_rank(),
        local_rank=distributed.get_local_rank(),
        world_size=distributed.get_world_size(),
        parallel_dims=parallel_dims,
        seed=run.seed,
        device_train_microbatch_size=None
        if run.device_train_microbatch_size == "auto"
        else run.device_train_microbatch_size,
        train_dataloader_len=_dataloader_len(train_dataloader),
        tokenizer=tokenizer,
    )


def _eval_loaders(eval_dataloader: Iterable | Mapping[str, Iterable] | None) -> dict[str, Iterable]:
    """``{label: loader}`` from one loader (label ``eval``), a mapping, or None."""
    if eval_dataloader is None:
        return {}
    if isinstance(eval_dataloader, Mapping):
        return dict(eval_dataloader)
    return {"eval": eval_dataloader}


def _loader_tokenizer(loader: Iterable | None) -> Any:
    """The tokenizer a dataloader (or its dataset, as the ``text`` loader's) holds, or None."""
    found = getattr(loader, "tokenizer", None)
    return found if found is not None else getattr(getattr(loader, "dataset", None), "tokenizer", None)


def _dataloader_len(loader: Iterable | None) -> int | None:
    """Batches per epoch, or None for a loader without a length."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
