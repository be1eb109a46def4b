"""A TrainConfig → its components → the Trainer: one small function per component, each a registry lookup.

Every YAML section that names a component becomes ``registry.X.get(name)(**kwargs)`` with its kwargs
checked against the constructor's signature first, so a typo fails before any model is built. The
run's settings reach the Trainer as they are (``trainer_settings``): nothing here relays a key or
invents a default.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from foundry import registry
from foundry.algorithms.float8 import blockwise_tensor_parallel_refusal
from foundry.callbacks.hf_checkpointer import adapter_export_refusal
from foundry.checkpoint.config import CheckpointConfig
from foundry.checkpoint.saver import Checkpointer
from foundry.config import TrainConfig, trainer_settings
from foundry.core import seed_everything
from foundry.data import load_tokenizer
from foundry.data.config import LoaderConfig, TokenizerConfig
from foundry.distributed import env
from foundry.distributed.config import ParallelismConfig, check_parallelism, with_fsdp_aliases
from foundry.distributed.context_parallel import refuse_mask_key
from foundry.errors import ConfigError
from foundry.eval.during_training import icl_refusal
from foundry.models.attention import mask_beyond_causal
from foundry.models.build import build_model, checked_model_config
from foundry.models.lora_checkpoint import has_pretrained_base
from foundry.models.mpt import MPTConfig
from foundry.models.nf4 import float8_refusal, full_finetuning_refusal
from foundry.models.tp_plan import check_tensor_parallel
from foundry.optim.optimizers import check_hyperparameters
from foundry.preference.objective import PreferenceObjective
from foundry.registry import bound_component, build_components, component_factory
from foundry.schema import config_to_dict, parse_dataclass
from foundry.trainer import Trainer


def build_trainer(cfg: TrainConfig, resolved: Mapping[str, Any] | None = None) -> Trainer:
    """Build every component of ``cfg`` and the Trainer that runs them.


    Args:
        cfg: the typed config (``foundry.config.load_train_config``).
        resolved: the resolved YAML, stored in checkpoints and sent to loggers (default: ``cfg`` as a dict).
    """
    checkpointer = check_config(cfg, env.get_world_size())
    # Tensor-parallel ranks load the same samples: streaming's replication, the finetuning loader's rank groups
    replication = parse_dataclass(ParallelismConfig, cfg.parallelism, "parallelism").tensor_parallel_degree
    device_batch_size = device_train_batch_size(cfg.global_train_batch_size, env.get_world_size(), replication)
    if cfg.device:
        torch_device(cfg.device)
    # Cheapest first, the model last: a typo or a missing data folder fails before a big model is built.
    callbacks = build_components(registry.callbacks, cfg.callbacks, "callbacks")
    algorithms = build_components(registry.algorithms, cfg.algorithms, "algorithms")
    loggers = build_components(registry.loggers, cfg.loggers, "loggers")
    scheduler = component_factory(registry.schedulers, cfg.scheduler, "scheduler")() if cfg.scheduler else None
    optimizer_factory = component_factory(registry.optimizers, cfg.optimizer, "optimizer", supplied=("params",))
    check_hyperparameters(optimizer_factory.keywords)
    check_datasets(cfg)  # a wrong data folder is named before the tokenizer that may sit inside it is read
    tokenizer = build_tokenizer(cfg.tokenizer)
    train_dataloader = build_dataloader(
        cfg.train_loader, tokenizer, device_batch_size, "train_loader", replication=replication
    )
    eval_dataloaders = build_eval_dataloaders(cfg, tokenizer, replication)
    seed_everything(cfg.seed)  # the model's initial weights depend on the seed alone
    model = build_model(cfg.model, tokenizer)
    return Trainer(
        model,
        train_dataloader,
        cfg.max_duration,
        optimizer_factory,  # called with model.parameters() once the model is on its device
        scheduler,
        eval_dataloaders or None,
        callbacks,
        algorithms,
        loggers,
        tokenizer=tokenizer,
        fsdp_config=cfg.fsdp_config,
        parallelism=cfg.parallelism,
        objective=build_objective(cfg, tokenizer),
        config=dict(resolved) if resolved is not None else config_to_dict(cfg),
        checkpointer=checkpointer,
        **trainer_settings(cfg, without=CheckpointConfig),
    )


def build_objective(cfg: TrainConfig, tokenizer: Any) -> PreferenceObjective | None:
    """The ``preference`` section's objective, or None: the model's own loss.

    A preference objective trains on a ``preference`` train_loader, and a ``preference`` loader needs the objective.
    """
    return PreferenceObjective(cfg.preference, tokenizer=tokenizer) if cfg.preference is not None else None


def check_config(cfg: TrainConfig, world_size: int | None = None) -> Checkpointer:
    """The checks of ``build_trainer`` before it builds anything: ``check_settings``, and the checkpoint section,
    whose ``Checkpointer`` (save_folder and load_path checked) is returned for the Trainer. ``foundry train`` runs
    them before it launches ranks, and ``--print-config`` too."""
    check_settings(cfg, world_size)
    return Checkpointer(cfg, cfg.run_name)


def check_settings(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Values that cannot work, read from the config alone (no file, no network, no process group): every
    component's name and arguments, the model section's values, and the parallel degrees against the model and
    ``world_size`` (the job's ranks; None: not known, those checks wait for the mesh)."""
    _check_hand_over(cfg)
    _check_adapters_only_base(cfg)
    _check_quantized_base(cfg)
    _check_sections(cfg)
    _check_packing(cfg)
    _check_preference(cfg)
    check_auto_checkpointing(cfg)
    for source, sections, key in (
        (registry.callbacks, cfg.callbacks, "callbacks"),
        (registry.algorithms, cfg.algorithms, "algorithms"),
        (registry.loggers, cfg.loggers, "loggers"),
    ):
        for name, kwargs in sections.items():
            bound_component(source, name, kwargs, f"{key}.{name}")
    if cfg.scheduler:
        component_factory(registry.schedulers, cfg.scheduler, "scheduler")
    if cfg.optimizer:
        optimizer = component_factory(registry.optimizers, cfg.optimizer, "optimizer", supplied=("params",))
        check_hyperparameters(optimizer.keywords)
    _check_model_and_parallelism(cfg, world_size)
    if world_size is not None:  # each group of ranks loading different samples loads an equal share
        tensor_parallel_degree = parse_dataclass(
            ParallelismConfig, cfg.parallelism, "parallelism"
        ).tensor_parallel_degree
        device_train_batch_size(cfg.global_train_batch_size, world_size, tensor_parallel_degree)


def _check_model_and_parallelism(cfg: TrainConfig, world_size: int | None) -> None:
    """The model section's values (without building the model) and the parallel degrees that depend on it."""
    model_config = checked_model_config(cfg.model)
    parallelism = parse_dataclass(ParallelismConfig, cfg.parallelism, "parallelism")
    if cfg.fsdp_config is not None:
        with warnings.catch_warnings():  # the deprecated spelling warns once, where the model is placed
            warnings.simplefilter("ignore", FutureWarning)
            parallelism = with_fsdp_aliases(parallelism, cfg.fsdp_config)
    check_parallelism(parallelism, world_size, getattr(model_config, "num_experts", None))
    if (degree := parallelism.tensor_parallel_degree) > 1:
        if not isinstance(model_config, MPTConfig):
            raise ConfigError(
                f"'parallelism.tensor_parallel_degree' is {degree} but model.name {cfg.model.get('name')!r} declares "
                "no tensor-parallel plan (mpt_causal_lm and llama_causal_lm do). Set the degree to 1."
            )
        check_tensor_parallel(model_config, degree)
        if model_config.peft_config is not None and "hf_checkpointer" in cfg.callbacks:
            raise adapter_export_refusal(degree)
        if parallelism.sequence_parallel and "fused_kernels" in cfg.algorithms:
            raise ConfigError(
                f"'parallelism.tensor_parallel_degree' is {degree} with parallelism.sequence_parallel, whose norms "
                "run on DTensors, which algorithms.fused_kernels' Triton norms do not take yet. Remove "
                "fused_kernels, or set parallelism.sequence_parallel: false."
            )
        if cfg.icl_tasks:
            raise icl_refusal(degree)
        if (cfg.algorithms.get("float8") or {}).get("recipe") == "blockwise":
            raise blockwise_tensor_parallel_refusal(degree)
    attn_config = getattr(model_config, "attn_config", None)  # foundry's families; hf_causal_lm has none
    if parallelism.context_parallel_degree > 1 and attn_config is not None and (key := mask_beyond_causal(attn_config)):
        refuse_mask_key(key)


def check_datasets(cfg: TrainConfig) -> None:
    """Each loader's ``check_dataset(dataset, key_path)``, where its registered builder carries one: a cheap check
    of its ``dataset`` section (the ``text`` loader's: the local folder exists), run before the tokenizer loads."""
    for key_path, loader in cfg.loaders():
        known = loader.name in registry.dataloaders  # an unknown name is reported with its key by build_dataloader
        check_dataset = getattr(registry.dataloaders.get(loader.name), "check_dataset", None) if known else None
        if check_dataset is not None:
            check_dataset(loader.dataset, f"{key_path}.dataset")


def torch_device(name: str) -> Any:
    """``torch.device(name)``, or a ConfigError naming the ``device`` key."""
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"'device' is {name!r}, which torch does not know; use cpu, cuda or cuda:N.") from None


def device_train_batch_size(global_train_batch_size: int, world_size: int, tensor_parallel_degree: int = 1) -> int:
    """Samples each process loads per batch: the global batch split evenly over the processes that load different
    samples (``tensor_parallel_degree`` ranks load the same ones)."""
    sample_ranks = world_size // tensor_parallel_degree
    if global_train_batch_size % sample_ranks:
        lower = global_train_batch_size - global_train_batch_size % sample_ranks
        processes = (
            f"the number of processes ({world_size})"
            if tensor_parallel_degree == 1
            else f"the number of processes that load different samples ({sample_ranks}: {world_size} processes / "
            f"parallelism.tensor_parallel_degree {tensor_parallel_degree})"
        )
        raise ConfigError(
            f"global_train_batch_size ({global_train_batch_size}) is not divisible by {processes}. Set it to a "
            f"multiple of {sample_ranks}, e.g. {lower or sample_ranks} or {lower + sample_ranks}."
        )
    return global_train_batch_size // sample_ranks


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
    cfg: LoaderConfig,
    tokenizer: Any,
    device_batch_size: int,
    key_path: str,
    for_eval: bool = False,
    replication: int = 1,
) -> Iterable:
    """The registered dataloader ``cfg.name`` for this process's share of each batch.

    ``for_eval``: a loader that can tag each sample with its index in the dataset (``sample_indices``)
    does, so that evaluation counts a sample once when the ranks' shares repeat it. ``replication``: how many
    consecutive ranks load the same samples (the tensor-parallel degree); a loader that cannot is refused.
    """
    settings = {field: getattr(cfg, field) for field in _LOADER_ARGUMENTS}
    factory = bound_component(registry.dataloaders, cfg.name, settings, key_path, f"{key_path}.name")
    parameters = inspect.signature(factory.func).parameters
    # A loader that takes key_path names its own keys in errors (e.g. 'eval_loader.dataset.split').
    extra: dict[str, Any] = {"key_path": key_path} if "key_path" in parameters else {}
    if for_eval and "sample_indices" in parameters:
        extra["sample_indices"] = True
    if replication > 1:
        if "replication" not in parameters:
            raise ConfigError(
                f"'{key_path}.name' is {cfg.name!r}, a loader that cannot give tensor-parallel ranks the same samples "
                "(parallelism.tensor_parallel_degree > 1); the text and finetuning loaders can. Use one of them, or "
                "set the degree to 1."
            )
        extra["replication"] = replication
    return factory(tokenizer=tokenizer, device_batch_size=device_batch_size, **extra)


def build_eval_dataloaders(cfg: TrainConfig, tokenizer: Any, replication: int = 1) -> dict[str, Iterable]:
    """``{label: loader}`` for ``eval_loader`` (label ``eval`` unless set) or each of ``eval_loaders``;
    ``replication`` as for ``build_dataloader``."""
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
        loaders[label] = build_dataloader(
            loader, tokenizer, cfg.device_eval_batch_size, key_path, for_eval=True, replication=replication
        )
    return loaders


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


def _check_packing(cfg: TrainConfig) -> None:
    """Packed finetuning rows need a model that masks attention between examples; hf_causal_lm cannot."""
    if cfg.model.get("name") != "hf_causal_lm":
        return
    for key, loader in cfg.loaders():
        ratio = loader.dataset.get("packing_ratio")
        if ratio not in (None, 1, 1.0):
            raise ConfigError(
                f"'{key}.dataset.packing_ratio' is {ratio!r}, which packs several examples per row, but hf_causal_lm "
                "cannot keep packed examples from attending to each other (LLM Foundry lets them, so each example "
                "sees the ones before it). Remove packing_ratio, or train mpt_causal_lm / llama_causal_lm with "
                "attn_config.attn_uses_sequence_id: true, which mask them."
            )


def _check_preference(cfg: TrainConfig) -> None:
    """A ``preference`` section trains on preference pairs, and pairs train only under one."""
    pairs = {key for key, loader in cfg.loaders() if loader.name == "preference"}
    if cfg.preference is not None and "train_loader" not in pairs:
        raise ConfigError(
            f"'preference' is set but 'train_loader.name' is {cfg.train_loader.name!r}; preference tuning reads "
            "(prompt, chosen, rejected) pairs: set train_loader.name to preference (docs/FINETUNING.md)."
        )
    if cfg.preference is None and pairs:
        raise ConfigError(
            f"'{sorted(pairs)[0]}.name' is preference, which loads (prompt, chosen, rejected) pairs, but the run has "
            "no 'preference' section to train on them: add 'preference: {loss_type: sigmoid, beta: 0.1}'."
        )
    degree = parse_dataclass(ParallelismConfig, cfg.parallelism, "parallelism").context_parallel_degree
    if cfg.preference is not None and degree > 1:
        raise ConfigError(
            f"'parallelism.context_parallel_degree' is {degree}, but preference tuning scores whole sequences on each "
            "rank; set the degree to 1 (shard the model with fsdp_config instead)."
        )
    if cfg.preference is not None and cfg.preference.reference == "precomputed" and len(cfg.loaders()) > 1:
        raise ConfigError(
            "'preference.reference' is precomputed, whose log-probabilities are the train pairs' only; remove the "
            "eval loaders, or use reference: copy."
        )
    if cfg.preference is not None and len(pairs) < len(cfg.loaders()):
        raise ConfigError(
            "Under 'preference', every eval loader is a preference loader too (its loss is the DPO loss)."
        )


def check_auto_checkpointing(cfg: TrainConfig) -> None:
    """``fsdp_config.activation_checkpointing: auto`` takes whole blocks and plans for a known microbatch: refused
    beside a target or an auto microbatch size before any rank starts (``foundry.config.auto_checkpointing``)."""
    if cfg.fsdp_config is None or cfg.fsdp_config.activation_checkpointing != "auto":
        return
    target = cfg.model.get("activation_checkpointing_target")
    if target not in (None, []):
        raise ConfigError(
            f"fsdp_config.activation_checkpointing is 'auto', which picks whole blocks, but "
            f"model.activation_checkpointing_target is {target!r}. Drop the target to let auto choose, or set "
            "activation_checkpointing: true to checkpoint what the target names."
        )
    if cfg.device_train_microbatch_size == "auto":
        raise ConfigError(
            "fsdp_config.activation_checkpointing and device_train_microbatch_size are both 'auto': each sizes "
            "itself by the memory the other leaves. Give device_train_microbatch_size a number (auto checkpointing "
            "then plans for it), or activation_checkpointing true or false."
        )


def _check_hand_over(cfg: TrainConfig) -> None:
    """A hand-over without a checkpoint would lose the run: fail before training, not at the first interval."""
    if "hand_over" in cfg.callbacks and not cfg.save_folder:
        raise ConfigError(
            "callbacks.hand_over stops the run to be continued elsewhere, from a checkpoint: set save_folder "
            "(a folder every machine reaches) and autoresume: true."
        )


def _check_quantized_base(cfg: TrainConfig) -> None:
    """NF4 or bf16 base weights train only as LoRA's frozen base; NF4 not beside float8, bf16 only under autocast."""
    if "quantize_base" in cfg.model:
        raise full_finetuning_refusal("model.quantize_base")
    if "base_dtype" in cfg.model:
        raise ConfigError(
            "'model.base_dtype': only LoRA's frozen base can be stored in bf16 (model.peft_config.base_dtype); a "
            "full finetune keeps fp32 weights for the optimizer to update. Move the key into peft_config, or remove it."
        )
    peft_config = cfg.model.get("peft_config") or {}
    if peft_config.get("quantize_base") and "float8" in cfg.algorithms:
        raise float8_refusal()
    if peft_config.get("base_dtype", "float32") != "float32" and str(cfg.precision) == "fp32":
        raise ConfigError(
            f"'model.peft_config.base_dtype' is {peft_config['base_dtype']!r} but precision is fp32: the frozen "
            "bf16 weights would meet fp32 activations in every GEMM. Set precision: amp_bf16, or base_dtype: float32."
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
