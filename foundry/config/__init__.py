"""The YAML adapter: LLM Foundry's train YAML schema, above the Trainer it configures.

Data flows one way: ``load_yaml`` reads the file, ``apply_overrides`` sets ``key.path=value`` pairs,
``resolve_interpolations`` fills every ``${a.b.c}`` reference and drops ``variables`` (all in
``foundry.yaml_config``), and ``foundry.schema.parse_dataclass`` turns the result into a
``TrainConfig``. A ``TrainConfig`` is the sections that their components own (``RunConfig``,
``CheckpointConfig``, ``EvalConfig``, ``ConsoleConfig``: the Trainer's keywords of the same names),
plus what ``foundry.config.build`` turns into objects (model, tokenizer, loaders, optimizer,
scheduler, registered components). No default is written twice: each lives on its section's field.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from foundry.checkpoint.config import CheckpointConfig
from foundry.core.bounds import check_bounds
from foundry.core.time import Time, positive_time
from foundry.data.config import LoaderConfig, TokenizerConfig
from foundry.distributed.config import FSDPConfig, ParallelismConfig
from foundry.errors import ConfigError, did_you_mean
from foundry.eval.config import EvalConfig
from foundry.loggers.config import ConsoleConfig
from foundry.preference.config import PreferenceConfig
from foundry.run_config import TRAINER_SECTIONS, RunConfig
from foundry.schema import doc
from foundry.yaml_config import load_config

__all__ = ["TrainConfig", "load_train_config", "trainer_settings"]


@dataclasses.dataclass(kw_only=True)
class TrainConfig(ConsoleConfig, EvalConfig, CheckpointConfig, RunConfig):  # fields: run, checkpoint, eval, console
    """Everything ``foundry train`` reads from a YAML; names and meanings follow LLM Foundry."""

    max_seq_len: int | None = field(
        default=None, metadata=doc("for ${max_seq_len} references, and for a loader dataset that sets none")
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
    global_train_batch_size: int = field(metadata=doc("samples per optimizer step, summed over all devices"))
    fsdp_config: FSDPConfig | None = field(
        default=None, metadata=doc("FSDP2 over several ranks (one rank: only its checkpointing and precision)")
    )
    parallelism: ParallelismConfig = field(
        default_factory=ParallelismConfig,
        metadata=doc(
            "degrees of the device mesh beyond data parallelism: context_parallel_degree, expert_parallel_degree, "
            "tensor_parallel_degree (LLM Foundry's tp_config.tensor_parallel_degree)"
        ),
    )
    preference: PreferenceConfig | None = field(
        default=None, metadata=doc("preference tuning (DPO, IPO, SimPO) on a 'preference' train_loader")
    )
    dist_timeout: float = field(default=600.0, metadata=doc("seconds before a stuck collective fails"))
    python_log_level: Literal["debug", "info", "warning", "error", "critical"] | None = field(
        default="debug", metadata=doc("level of the 'foundry' Python logger")
    )
    icl_max_seq_len: int | None = field(default=None, metadata=doc("LLM Foundry's finetune spelling of icl_seq_len"))
    dataset: dict[str, Any] | None = field(
        default=None,
        metadata=doc("no effect: LLM Foundry's finetune YAMLs keep a YAML anchor of the loaders' dataset here"),
    )

    def __post_init__(self) -> None:
        for section in TRAINER_SECTIONS:
            section.__post_init__(self)
        self.icl_seq_len = merge_alias(self.icl_seq_len, self.icl_max_seq_len, "icl_seq_len", "icl_max_seq_len")
        if self.icl_seq_len is None:
            self.icl_seq_len = self.max_seq_len
        for _, loader in self.loaders():  # a `<<:` merge may drop it
            if self.max_seq_len is not None:
                loader.dataset.setdefault("max_seq_len", self.max_seq_len)
        for name in ("model", "optimizer", "scheduler"):
            value = getattr(self, name)
            if value is not None and not value.get("name"):
                raise ConfigError(f"'{name}.name' is missing: every {name} section names what to build.")
        check_bounds(vars(self))
        for path, loader in self.loaders():
            check_bounds(vars(loader), path)
        positive_time(self.max_duration, "max_duration")
        if self.eval_loader is not None and self.eval_loaders:
            raise ConfigError("Both 'eval_loader' and 'eval_loaders' are set; keep one (a list under 'eval_loader').")

    def loaders(self) -> list[tuple[str, LoaderConfig]]:
        """Every loader the config sets, with its key path (``train_loader``, ``eval_loaders[1]``...)."""
        named = [("train_loader", self.train_loader), ("eval_loader", self.eval_loader)]
        named += [(f"eval_loaders[{index}]", loader) for index, loader in enumerate(self.eval_loaders)]
        return [(key_path, loader) for key_path, loader in named if loader is not None]


def trainer_settings(cfg: TrainConfig, without: type | None = None) -> dict[str, Any]:
    """The keys of ``cfg`` that the Trainer takes as they are: every field of ``TRAINER_SECTIONS`` (but the
    section ``without``, which the caller hands over whole)."""
    sections = [section for section in TRAINER_SECTIONS if section is not without]
    return {field.name: getattr(cfg, field.name) for section in sections for field in dataclasses.fields(section)}


def merge_alias(value: Any, alias_value: Any, key: str, alias: str) -> Any:
    """One key that LLM Foundry spells two ways: either may be set, or both to the same value."""
    if alias_value is not None and value is not None and alias_value != value:
        raise ConfigError(f"'{key}' is {value} and '{alias}' (the same setting) is {alias_value}; keep one.")
    return value if value is not None else alias_value


# ------------------------------------------------------------------------------------ loading
def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[TrainConfig, dict[str, Any]]:
    """Read, override, interpolate and validate a train YAML.

    Returns:
        The typed config, and the resolved plain dict (``run_name`` filled in) for loggers and checkpoints.
    """
    cfg, resolved = load_config(TrainConfig, path, overrides, _prepare)
    resolved["run_name"] = cfg.run_name
    return cfg, resolved


def _prepare(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level checks with better messages than a generic parse, before ``parse_dataclass`` runs."""
    hints = typing.get_type_hints(TrainConfig)
    prepared = {}
    for key, value in _with_tp_config(data).items():
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


def _with_tp_config(data: dict[str, Any]) -> dict[str, Any]:
    """LLM Foundry's ``tp_config`` as ``parallelism.tensor_parallel_degree``; its other keys are refused by name
    (foundry's models declare their own plan)."""
    if "tp_config" not in data:
        return data
    data = dict(data)
    tp_config = data.pop("tp_config") or {}
    if not isinstance(tp_config, dict):
        raise ConfigError(f"'tp_config' is {tp_config!r}; write 'parallelism: {{tensor_parallel_degree: 2}}'.")
    for key in tp_config:
        if key != "tensor_parallel_degree":
            raise ConfigError(
                f"'tp_config.{key}' has no foundry equivalent: each model family declares which layers tensor "
                "parallelism splits (mpt_causal_lm and llama_causal_lm: attention and FFN). Remove the key and write "
                "'parallelism: {tensor_parallel_degree: N}'."
            )
    degree = tp_config.get("tensor_parallel_degree")
    parallelism = dict(data.get("parallelism") or {})
    if degree is not None:
        if parallelism.get("tensor_parallel_degree", degree) != degree:
            raise ConfigError(
                f"'tp_config.tensor_parallel_degree' is {degree} but 'parallelism.tensor_parallel_degree' is "
                f"{parallelism['tensor_parallel_degree']}; they name the same degree. Keep only the parallelism key."
            )
        data["parallelism"] = {**parallelism, "tensor_parallel_degree": degree}
    return data
