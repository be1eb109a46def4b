"""YAML → typed config: LLM Foundry's train YAML schema, ``${...}`` interpolation and CLI overrides.

Data flows one way: ``load_yaml`` reads the file, ``apply_overrides`` sets ``key.path=value`` pairs,
``resolve_interpolations`` fills every ``${a.b.c}`` reference and drops ``variables``, and
``foundry.schema.parse_dataclass`` turns the result into a ``TrainConfig``. The dataclasses below
are the one place defaults live; builders and the CLI read them from here, and the Python API
(``Trainer``, the dataloader builders, the activation checkpointing algorithm) takes its keyword
defaults from ``TRAIN_DEFAULTS``, ``LOADER_DEFAULTS`` and ``FSDP_DEFAULTS``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import typing
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from foundry.config.icl import parse_gauntlet, parse_icl_tasks
from foundry.config.yaml import (
    apply_overrides,
    config_to_dict,
    load_yaml,
    resolve_interpolations,
    to_yaml,
    yaml_section,
)
from foundry.core.bounds import check_bounds
from foundry.core.paths import check_storage_path
from foundry.core.time import Time, positive_time
from foundry.errors import ConfigError, did_you_mean
from foundry.schema import parse_dataclass

__all__ = [
    "FSDP_DEFAULTS",
    "LOADER_DEFAULTS",
    "TRAIN_DEFAULTS",
    "FSDPConfig",
    "LoaderConfig",
    "TokenizerConfig",
    "TrainConfig",
    "apply_overrides",
    "config_to_dict",
    "default_run_name",
    "fill_run_name",
    "load_train_config",
    "load_yaml",
    "resolve_interpolations",
    "to_yaml",
    "yaml_section",
]


def doc(text: str) -> dict[str, str]:
    """Field metadata: the one-line description ``foundry train --help`` prints for a key."""
    return {"doc": text}


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    name: str = field(metadata=doc("Hugging Face tokenizer name or local folder"))
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=doc("passed to the tokenizer's from_pretrained"))


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """A dataloader: ``name`` picks a registered builder; the other keys are its arguments."""

    name: str = field(metadata=doc("registered dataloader, e.g. text"))
    dataset: dict[str, Any] = field(
        default_factory=dict, metadata=doc("the dataset's own keys (local, split, max_seq_len...)")
    )
    label: str | None = field(default=None, metadata=doc("eval metrics are logged as metrics/<label>/..."))
    drop_last: bool = field(default=False, metadata=doc("drop the last incomplete batch"))
    num_workers: int = field(default=0, metadata=doc("dataloader worker processes"))
    pin_memory: bool = field(default=True, metadata=doc("page-locked host memory for faster copies to the GPU"))
    prefetch_factor: int | None = field(
        default=None, metadata=doc("batches each worker loads ahead (torch's default when None)")
    )
    persistent_workers: bool = field(
        default=False, metadata=doc("keep workers alive between epochs (needs num_workers > 0)")
    )
    timeout: float = field(default=0.0, metadata=doc("seconds to wait for a batch from a worker (0 = forever)"))


@dataclasses.dataclass(kw_only=True)
class FSDPConfig:
    """LLM Foundry's ``fsdp_config`` keys; validated here, applied by ``foundry.distributed``."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] = (
        field(default="FULL_SHARD", metadata=doc("how parameters, gradients and optimizer state are sharded"))
    )
    mixed_precision: Literal["DEFAULT", "PURE", "FULL"] = field(
        default="DEFAULT", metadata=doc("with amp precisions: PURE/DEFAULT/FULL compute and reduce dtypes")
    )
    activation_checkpointing: bool = field(default=False, metadata=doc("recompute block activations in backward"))
    activation_checkpointing_reentrant: bool = field(
        default=False, metadata=doc("torch's reentrant checkpoint (default: the non-reentrant one torch recommends)")
    )
    activation_cpu_offload: bool = field(
        default=False, metadata=doc("offload saved activations to the CPU (CUDA only)")
    )
    limit_all_gathers: bool = field(
        default=True, metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 bounds in-flight all-gathers")
    )
    sync_module_states: bool = field(default=False, metadata=doc("broadcast rank 0's weights at wrap time"))
    use_orig_params: bool = field(
        default=True, metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 always uses the parameters")
    )
    state_dict_type: Literal["full", "sharded", "local"] = field(
        default="full",
        metadata=doc("no effect (accepted for LLM Foundry YAMLs): checkpoints are always sharded DCP folders"),
    )
    forward_prefetch: bool = field(default=False, metadata=doc("prefetch the next all-gather in forward"))
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] = field(
        default="BACKWARD_POST",
        metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 always prefetches the next block in backward"),
    )
    verbose: bool = field(default=False, metadata=doc("log how modules are wrapped"))
    cpu_offload: bool = field(default=False, metadata=doc("keep shards and the optimizer step on the CPU (CUDA only)"))


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Everything ``foundry train`` reads from a YAML; names and meanings follow LLM Foundry."""

    run_name: str | None = field(default=None, metadata=doc("default: $RUN_NAME, else foundry-<date>-<time>"))
    seed: int = field(default=17, metadata=doc("seed for weights, data order and dropout"))
    max_seq_len: int | None = field(
        default=None, metadata=doc("for ${max_seq_len} references; the model and data have their own")
    )
    model: dict[str, Any] = field(metadata=doc("'name' picks a registered model; other keys go to it"))
    tokenizer: TokenizerConfig = field(metadata=doc("tokenizer name and kwargs"))
    train_loader: LoaderConfig = field(metadata=doc("training data"))
    eval_loader: LoaderConfig | None = field(
        default=None, metadata=doc("evaluation data; a list of loaders with labels also works")
    )
    eval_loaders: list[LoaderConfig] = field(default_factory=list, metadata=doc("several labelled eval loaders"))
    optimizer: dict[str, Any] = field(metadata=doc("'name' picks a registered optimizer (decoupled_adamw, adamw...)"))
    scheduler: dict[str, Any] | None = field(
        default=None, metadata=doc("'name' picks an LR schedule; none = constant LR")
    )
    algorithms: dict[str, dict[str, Any] | None] = field(default_factory=dict, metadata=doc("name -> kwargs"))
    callbacks: dict[str, dict[str, Any] | None] = field(default_factory=dict, metadata=doc("name -> kwargs"))
    loggers: dict[str, dict[str, Any] | None] = field(
        default_factory=dict, metadata=doc("name -> kwargs, e.g. wandb: {}")
    )
    max_duration: Time = field(metadata=doc("how long to train: 4800ba, 1ep, 2000000tok"))
    eval_interval: Time = field(
        default=Time.parse("1ep"), metadata=doc("how often to evaluate (a bare int counts batches)")
    )
    eval_first: bool = field(default=False, metadata=doc("evaluate before the first batch"))
    eval_subset_num_batches: int = field(default=-1, metadata=doc("batches per evaluation (-1 = the whole eval set)"))
    global_train_batch_size: int = field(metadata=doc("samples per optimizer step, summed over all devices"))
    device_train_microbatch_size: int | Literal["auto"] | None = field(
        default=None, metadata=doc("samples per forward/backward (gradients accumulate); none = the whole device batch")
    )
    device_eval_batch_size: int | None = field(default=None, metadata=doc("eval samples per device per batch"))
    precision: Literal["fp32", "amp_bf16", "amp_fp16"] = field(default="amp_bf16", metadata=doc("compute precision"))
    device: str | None = field(default=None, metadata=doc("cpu, cuda, ... (none = this rank's GPU if any)"))
    fsdp_config: FSDPConfig | None = field(
        default=None, metadata=doc("FSDP2 over several ranks (one rank: only its checkpointing and precision)")
    )
    compile_config: bool | Literal["auto"] | dict[str, Any] = field(
        default="auto",
        metadata=doc(
            "torch.compile: auto = on a GPU (whole model on one rank, each block when sharded), never on CPU; "
            "false = eager; true = everywhere; a mapping = algorithms.torch_compile's keys"
        ),
    )
    fuse_weight_grad_accumulation: bool = field(
        default=True,
        metadata=doc(
            "unsharded runs: each linear sums its weight gradient inside the GEMM and casts its weight once a "
            "batch (docs/PERFORMANCE.md); false = autograd's accumulation"
        ),
    )
    dist_timeout: float = field(default=600.0, metadata=doc("seconds before a stuck collective fails"))
    expandable_segments: bool = field(
        default=True, metadata=doc("CUDA allocator expandable segments (less fragmentation)")
    )
    progress_bar: bool = field(default=False, metadata=doc("show a progress bar instead of log lines"))
    log_to_console: bool = field(default=True, metadata=doc("print metrics to the console"))
    console_log_interval: Time = field(default=Time.parse("1ba"), metadata=doc("how often metrics are printed"))
    python_log_level: Literal["debug", "info", "warning", "error", "critical"] | None = field(
        default="debug", metadata=doc("level of the 'foundry' Python logger")
    )
    run_folder: str = field(default="runs/{run_name}", metadata=doc("where metrics.jsonl goes"))
    save_folder: str | None = field(default=None, metadata=doc("checkpoint folder; {run_name} is filled in"))
    save_interval: Time = field(default=Time.parse("1000ba"), metadata=doc("how often to checkpoint"))
    save_num_checkpoints_to_keep: int = field(default=-1, metadata=doc("newest checkpoints kept on disk (-1 = all)"))
    save_overwrite: bool = field(default=False, metadata=doc("overwrite existing checkpoints"))
    save_async: bool = field(default=False, metadata=doc("write checkpoints in the background while training goes on"))
    save_upload_retries: int = field(
        default=3, metadata=doc("object-store save_folder: retries of each failed upload before the checkpoint fails")
    )
    save_upload_backoff_s: float = field(
        default=2.0, metadata=doc("seconds before the first retry of an upload; each next retry waits twice as long")
    )
    save_max_failed_uploads: int = field(
        default=3,
        metadata=doc("stop the run once this many checkpoints in a row failed to upload (kept locally till relaunch)"),
    )
    save_weights_only: bool = field(default=False, metadata=doc("save only model weights"))
    load_path: str | None = field(default=None, metadata=doc("checkpoint to start from"))
    load_weights_only: bool = field(default=False, metadata=doc("load only weights (fresh optimizer and schedule)"))
    load_strict_model_weights: bool = field(default=True, metadata=doc("fail on missing or unexpected weight names"))
    autoresume: bool = field(default=False, metadata=doc("resume from the newest checkpoint in save_folder"))
    icl_tasks: str | list[dict[str, Any]] | None = field(
        default=None, metadata=doc("ICL tasks run at eval_interval: a tasks YAML path or the list (docs/EVAL.md)")
    )
    eval_gauntlet: str | dict[str, Any] | None = field(
        default=None, metadata=doc("averages ICL tasks into categories: a gauntlet YAML path or the mapping")
    )
    icl_seq_len: int | None = field(
        default=None, metadata=doc("tokens per ICL row (none = max_seq_len, else model.max_seq_len)")
    )

    def __post_init__(self) -> None:
        if self.run_name is None:
            self.run_name = default_run_name()
        check_icl(self)
        for section in ("model", "optimizer", "scheduler"):
            value = getattr(self, section)
            if value is not None and not value.get("name"):
                raise ConfigError(f"'{section}.name' is missing: every {section} section names what to build.")
        check_bounds(vars(self))
        loaders = [("train_loader", self.train_loader), ("eval_loader", self.eval_loader)]
        for path, loader in [*loaders, *((f"eval_loaders[{i}]", each) for i, each in enumerate(self.eval_loaders))]:
            if loader is not None:
                check_bounds(vars(loader), path)
        for key in ("max_duration", "eval_interval", "save_interval", "console_log_interval"):
            positive_time(getattr(self, key), key)
        check_storage_path(self.save_folder, "'save_folder'")
        check_storage_path(self.load_path, "'load_path'")
        if self.eval_loader is not None and self.eval_loaders:
            raise ConfigError("Both 'eval_loader' and 'eval_loaders' are set; keep one (a list under 'eval_loader').")


_GENERATED_RUN_NAME = re.compile(r"^foundry-\d{8}-\d{6}$")


def default_run_name() -> str:
    """``$RUN_NAME`` (or Composer's ``$COMPOSER_RUN_NAME``), else ``foundry-<date>-<time>``."""
    return (
        os.environ.get("RUN_NAME") or os.environ.get("COMPOSER_RUN_NAME") or f"foundry-{time.strftime('%Y%m%d-%H%M%S')}"
    )


def is_generated_run_name(run_name: str) -> bool:
    """Whether ``run_name`` is one ``default_run_name`` made up (``foundry-<date>-<time>``), not one a user gave."""
    return bool(_GENERATED_RUN_NAME.match(run_name))


def fill_run_name(path: str | None, run_name: str | None) -> str | None:
    """``path`` with ``{run_name}`` filled in (Composer's convention); other braces, like ``{rank}``, stay."""
    if path is None or run_name is None:
        return path
    return path.replace("{run_name}", run_name)


def field_defaults(cls: type) -> SimpleNamespace:
    """The defaults of ``cls``'s fields by name (fields without one are left out), e.g. ``.precision``."""
    defaults = {}
    for config_field in dataclasses.fields(cls):
        if config_field.default is not dataclasses.MISSING:
            defaults[config_field.name] = config_field.default
        elif config_field.default_factory is not dataclasses.MISSING:
            defaults[config_field.name] = config_field.default_factory()
    return SimpleNamespace(**defaults)


# The YAML's defaults, for the Python API's keyword arguments of the same names: one value for both.
TRAIN_DEFAULTS = field_defaults(TrainConfig)
LOADER_DEFAULTS = field_defaults(LoaderConfig)
FSDP_DEFAULTS = field_defaults(FSDPConfig)


def check_icl(cfg: TrainConfig) -> None:
    """Parse ``icl_tasks`` and ``eval_gauntlet`` now, so a typo fails before training starts."""
    if cfg.icl_tasks is not None:
        parse_icl_tasks(cfg.icl_tasks)
    if cfg.eval_gauntlet is not None:
        if cfg.icl_tasks is None:
            raise ConfigError(
                "'eval_gauntlet' averages ICL tasks, but 'icl_tasks' is not set; add it or drop the gauntlet."
            )
        parse_gauntlet(cfg.eval_gauntlet)


# ------------------------------------------------------------------------------------ loading
def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[TrainConfig, dict[str, Any]]:
    """Read, override, interpolate and validate a train YAML.

    Returns:
        The typed config, and the resolved plain dict (``run_name`` filled in) for loggers and checkpoints.
    """
    raw = apply_overrides(load_yaml(path), overrides)
    try:
        resolved = resolve_interpolations(raw)
        cfg = parse_dataclass(TrainConfig, _prepare(resolved), "")
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    resolved["run_name"] = cfg.run_name
    return cfg, resolved


def _prepare(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level checks with better messages than a generic parse, before ``parse_dataclass`` runs."""
    hints = typing.get_type_hints(TrainConfig)
    prepared = {}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(
                f"Unknown top-level key '{key}'.{did_you_mean(str(key), hints)} `foundry train --help` lists every "
                "key. Values that other keys only reference (YAML anchors, ${...}) belong under 'variables'."
            )
        if key == "eval_loader" and isinstance(value, list):  # LLM Foundry's list form
            if data.get("eval_loaders"):
                raise ConfigError("Both 'eval_loader' and 'eval_loaders' are set; keep one.")
            key = "eval_loaders"
        if value is None and type(None) not in typing.get_args(hints[key]):
            continue  # an empty YAML value (`callbacks:`) means the default
        prepared[key] = value
    return prepared
