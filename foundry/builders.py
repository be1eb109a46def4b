"""Typed config → components → Trainer: one small function per component, each a registry lookup.

Every YAML section becomes ``registry.X.get(name)(**kwargs)`` with its kwargs checked against the
constructor's signature first, so a typo fails before any model is built. Defaults live in
``foundry.config``; nothing here invents one.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from foundry import registry
from foundry.algorithms.torch_compile import from_compile_config
from foundry.checkpoint import latest_checkpoint
from foundry.checkpoint.adapters import has_pretrained_base
from foundry.checkpoint.owner import check_save_folder_owner
from foundry.config import (
    LoaderConfig,
    TokenizerConfig,
    TrainConfig,
    config_to_dict,
    fill_run_name,
    is_generated_run_name,
)
from foundry.config.icl import parse_gauntlet, parse_icl_tasks
from foundry.core import seed_everything
from foundry.core.paths import check_writable_folder, is_object_store_url
from foundry.data import load_tokenizer
from foundry.distributed import env
from foundry.distributed.parallelize import shards
from foundry.errors import ConfigError
from foundry.eval.callback import ICLEval
from foundry.eval.evaluator import ICLEvaluator
from foundry.models.build import build_model
from foundry.optim.optimizers import check_hyperparameters
from foundry.registry import bound_component, build_components, component_factory
from foundry.trainer import Trainer


def build_trainer(cfg: TrainConfig, resolved: Mapping[str, Any] | None = None) -> Trainer:
    """Build every component of ``cfg`` and the Trainer that runs them.

    Args:
        cfg: the typed config (``foundry.config.load_train_config``).
        resolved: the resolved YAML, stored in checkpoints and sent to loggers (default: ``cfg`` as a dict).
    """
    _reject_unimplemented(cfg)
    _check_hand_over(cfg)
    _check_checkpoint_paths(cfg)
    _check_adapters_only_base(cfg)
    _apply_cuda_allocator_settings(cfg.expandable_segments)
    device_batch_size = device_train_batch_size(cfg.global_train_batch_size, env.get_world_size())
    # Cheapest first, the model last: a typo or a missing data folder fails before a big model is built.
    _check_sections(cfg)
    callbacks = build_components(registry.callbacks, cfg.callbacks, "callbacks")
    algorithms = build_components(registry.algorithms, cfg.algorithms, "algorithms") + build_compile(cfg)
    loggers = build_components(registry.loggers, cfg.loggers, "loggers")
    scheduler = component_factory(registry.schedulers, cfg.scheduler, "scheduler")() if cfg.scheduler else None
    optimizer_factory = component_factory(registry.optimizers, cfg.optimizer, "optimizer", supplied=("params",))
    check_hyperparameters(optimizer_factory.keywords)
    tokenizer = build_tokenizer(cfg.tokenizer)
    callbacks += build_icl_eval(cfg, tokenizer)
    train_dataloader = build_dataloader(cfg.train_loader, tokenizer, device_batch_size, "train_loader")
    eval_dataloaders = build_eval_dataloaders(cfg, tokenizer)
    seed_everything(cfg.seed)  # the model's initial weights depend on the seed alone
    return Trainer(
        model=build_model(cfg.model, tokenizer),
        train_dataloader=train_dataloader,
        eval_dataloader=eval_dataloaders or None,
        optimizers=optimizer_factory,  # called with model.parameters() once the model is on its device
        schedulers=scheduler,
        max_duration=cfg.max_duration,
        eval_interval=cfg.eval_interval,
        eval_first=cfg.eval_first,
        eval_subset_num_batches=cfg.eval_subset_num_batches,
        callbacks=callbacks,
        algorithms=algorithms,
        loggers=loggers,
        precision=cfg.precision,
        device=cfg.device,
        fsdp_config=cfg.fsdp_config,
        device_train_microbatch_size=cfg.device_train_microbatch_size,
        fuse_weight_grad_accumulation=cfg.fuse_weight_grad_accumulation,
        save_folder=fill_run_name(cfg.save_folder, cfg.run_name),
        save_interval=cfg.save_interval,
        save_num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep,
        save_async=cfg.save_async,
        save_overwrite=cfg.save_overwrite,
        save_upload_retries=cfg.save_upload_retries,
        save_upload_backoff_s=cfg.save_upload_backoff_s,
        save_max_failed_uploads=cfg.save_max_failed_uploads,
        load_path=fill_run_name(cfg.load_path, cfg.run_name),
        load_weights_only=cfg.load_weights_only,
        autoresume=cfg.autoresume,
        seed=cfg.seed,
        run_name=cfg.run_name,
        run_folder=fill_run_name(cfg.run_folder, cfg.run_name),
        log_to_console=cfg.log_to_console,
        progress_bar=cfg.progress_bar,
        console_log_interval=cfg.console_log_interval,
        config=dict(resolved) if resolved is not None else config_to_dict(cfg),
    )


def build_compile(cfg: TrainConfig) -> list:
    """``compile_config`` as a ``torch_compile`` algorithm (none when off, or when ``algorithms`` has one)."""
    if "torch_compile" in cfg.algorithms:
        if cfg.compile_config != "auto":
            raise ConfigError(
                f"compile_config is {cfg.compile_config!r} and algorithms.torch_compile is set: both configure "
                "torch.compile. Keep one (compile_config: false with algorithms.torch_compile is a contradiction)."
            )
        return []
    device = torch_device(cfg.device) if cfg.device else env.default_device()
    sharded = env.get_world_size() > 1 or (cfg.fsdp_config is not None and shards(cfg.fsdp_config, device))
    algorithm = from_compile_config(cfg.compile_config, device, sharded)
    return [algorithm] if algorithm is not None else []


def torch_device(name: str) -> Any:
    """``torch.device(name)``, or a ConfigError naming the ``device`` key."""
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"'device' is {name!r}, which torch does not know; use cpu, cuda or cuda:N.") from None


def device_train_batch_size(global_train_batch_size: int, world_size: int) -> int:
    """Samples each process loads per batch: the global batch split evenly over processes."""
    if global_train_batch_size % world_size:
        lower = global_train_batch_size - global_train_batch_size % world_size
        raise ConfigError(
            f"global_train_batch_size ({global_train_batch_size}) is not divisible by the number of processes "
            f"({world_size}). Set it to a multiple of {world_size}, e.g. {lower or world_size} or {lower + world_size}."
        )
    return global_train_batch_size // world_size


def build_tokenizer(cfg: TokenizerConfig) -> Any:
    return load_tokenizer(cfg.name, **cfg.kwargs)


# Every LoaderConfig key but name and label: a registered dataloader builder accepts all of them.
_LOADER_ARGUMENTS = (
    "dataset",
    "drop_last",
    "num_workers",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "timeout",
)


def build_dataloader(
    cfg: LoaderConfig, tokenizer: Any, device_batch_size: int, key_path: str, for_eval: bool = False
) -> Iterable:
    """The registered dataloader ``cfg.name`` for this process's share of each batch.

    ``for_eval``: a loader that can tag each sample with its index in the dataset (``sample_indices``)
    does, so that evaluation counts a sample once when the ranks' shares repeat it.
    """
    settings = {field: getattr(cfg, field) for field in _LOADER_ARGUMENTS}
    factory = bound_component(registry.dataloaders, cfg.name, settings, key_path, f"{key_path}.name")
    parameters = inspect.signature(factory.func).parameters
    # A loader that takes key_path names its own keys in errors (e.g. 'eval_loader.dataset.split').
    extra: dict[str, Any] = {"key_path": key_path} if "key_path" in parameters else {}
    if for_eval and "sample_indices" in parameters:
        extra["sample_indices"] = True
    return factory(tokenizer=tokenizer, device_batch_size=device_batch_size, **extra)


def build_eval_dataloaders(cfg: TrainConfig, tokenizer: Any) -> dict[str, Iterable]:
    """``{label: loader}`` for ``eval_loader`` (label ``eval`` unless set) or each of ``eval_loaders``."""
    if cfg.eval_loader is None and not cfg.eval_loaders:
        return {}
    if cfg.device_eval_batch_size is None:
        raise ConfigError("An eval loader is set, so 'device_eval_batch_size' is needed (e.g. 16).")
    if cfg.eval_loader is not None:
        named = [(cfg.eval_loader.label or "eval", cfg.eval_loader, "eval_loader")]
    else:
        named = [(loader.label, loader, f"eval_loaders[{i}]") for i, loader in enumerate(cfg.eval_loaders)]
    loaders: dict[str, Iterable] = {}
    for label, loader, key_path in named:
        if not label:
            raise ConfigError(f"'{key_path}.label' is missing: each of several eval loaders needs a label.")
        if label in loaders:
            raise ConfigError(f"'{key_path}.label' is '{label}', which another eval loader already uses.")
        loaders[label] = build_dataloader(loader, tokenizer, cfg.device_eval_batch_size, key_path, for_eval=True)
    return loaders


def build_icl_eval(cfg: TrainConfig, tokenizer: Any) -> list:
    """The ``ICLEval`` callback for ``icl_tasks`` (run at ``eval_interval``), or nothing."""
    if cfg.icl_tasks is None:
        return []

    seq_len = cfg.icl_seq_len or cfg.max_seq_len or cfg.model.get("max_seq_len")
    if not isinstance(seq_len, int):
        raise ConfigError("'icl_tasks' is set but no sequence length is known: set 'icl_seq_len' (e.g. 1024).")
    if cfg.device_eval_batch_size is None:
        raise ConfigError("'icl_tasks' is set, so 'device_eval_batch_size' is needed (rows per ICL forward, e.g. 16).")
    evaluator = ICLEvaluator(parse_icl_tasks(cfg.icl_tasks), tokenizer, seq_len, cfg.device_eval_batch_size)
    gauntlet = parse_gauntlet(cfg.eval_gauntlet) if cfg.eval_gauntlet is not None else None
    return [ICLEval(evaluator, cfg.eval_interval, gauntlet, cfg.eval_first)]


def _check_sections(cfg: TrainConfig) -> None:
    """An algorithm listed under callbacks (or the reverse) names the section it belongs in."""
    for section, other, names in (
        ("callbacks", "algorithms", cfg.callbacks),
        ("algorithms", "callbacks", cfg.algorithms),
    ):
        for name in names:
            if name not in getattr(registry, section) and name in getattr(registry, other):
                kind = "algorithm (it changes the run)" if other == "algorithms" else "callback (it observes the run)"
                raise ConfigError(f"'{section}.{name}' is an {kind}: move it under '{other}'.")


def _reject_unimplemented(cfg: TrainConfig) -> None:
    """Keys the YAML schema accepts but the Trainer cannot honour yet: fail instead of ignoring them."""
    if cfg.save_weights_only:
        raise ConfigError("save_weights_only: true is not supported yet; remove it to save full checkpoints.")
    if not cfg.load_strict_model_weights:
        raise ConfigError("load_strict_model_weights: false is not supported yet; checkpoints load strictly.")


def _check_checkpoint_paths(cfg: TrainConfig) -> None:
    """save_folder must be writable and load_path must exist now, not after the model and data are built."""
    # Object-store folders are checked when the Trainer reaches the store (bucket, credentials).
    save_folder = fill_run_name(cfg.save_folder, cfg.run_name)
    on_store = is_object_store_url(save_folder)
    load_path = fill_run_name(cfg.load_path, cfg.run_name)
    if save_folder and not on_store:
        check_writable_folder(save_folder, "save_folder")
        named = not is_generated_run_name(cfg.run_name)
        options = {"autoresume": cfg.autoresume, "overwrite": cfg.save_overwrite, "load_path": load_path}
        check_save_folder_owner(save_folder, cfg.run_name, named=named, **options)
    resumes = cfg.autoresume and save_folder and (on_store or latest_checkpoint(save_folder) is not None)
    if load_path and not resumes and not is_object_store_url(load_path) and not Path(load_path).exists():
        raise ConfigError(
            f"'load_path' is '{load_path}', where nothing exists. Give a checkpoint folder (e.g. "
            "<save_folder>/ep0-ba100) or the save_folder of a run that saved one, or remove load_path to start from "
            "fresh weights."
        )


def _check_hand_over(cfg: TrainConfig) -> None:
    """A hand-over without a checkpoint would lose the run: fail before training, not at the first interval."""
    if "hand_over" in cfg.callbacks and not cfg.save_folder:
        raise ConfigError(
            "callbacks.hand_over stops the run to be continued elsewhere, from a checkpoint: set save_folder "
            "(a folder every machine reaches) and autoresume: true."
        )


def _check_adapters_only_base(cfg: TrainConfig) -> None:
    """Adapters-only checkpoints name their base through load_path: without one, the base would be lost."""
    peft_config = cfg.model.get("peft_config") or {}
    if peft_config.get("save_adapters_only") and not cfg.load_path and not has_pretrained_base(cfg.model):
        raise ConfigError(
            "model.peft_config.save_adapters_only: true saves the LoRA adapters without the base weights, which "
            "checkpoints then find through load_path; set load_path to the base checkpoint (e.g. the output of "
            "`foundry convert from-hf`), or set save_adapters_only: false. (An hf_causal_lm with pretrained: true "
            "needs none: its base is pretrained_model_name_or_path.)"
        )


def _apply_cuda_allocator_settings(expandable_segments: bool) -> None:
    """LLM Foundry's default: expandable segments cut fragmentation when sequence lengths vary."""
    if expandable_segments and torch.cuda.is_available():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
