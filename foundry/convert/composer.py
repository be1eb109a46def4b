"""``foundry convert from-composer``: an LLM Foundry (Composer) checkpoint into a foundry checkpoint.

LLM Foundry's models are Composer ``HuggingFaceModel``s: the checkpoint's ``state.model`` keys are
``model.<the wrapped model's key>``, and ``state.integrations.huggingface.model.config`` holds the
wrapped model's config and class. ``hf_causal_lm`` runs of Llama (and Hugging Face MPT) convert
through the ``from-hf`` adapters; LLM Foundry's own ``mpt_causal_lm`` is foundry's ``mpt_causal_lm``
(same keys, same config keys). The tokenizer the checkpoint stored (``state.integrations.huggingface.
tokenizer``) is written beside the converted checkpoint and named by its config. With ``with_optimizer``,
the Adam moments, step count and LRs (mapped to foundry's parameter names), the timestamp and the train
data position (Composer's ``state.dataset_state``, the same streaming dataset state foundry's loaders
keep) come along, so a run continues where Composer stopped, on the sample Composer would read next.
The file is read through an allowlist (``foundry.convert.composer_pickle``): nothing in it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from foundry.checkpoint import latest_checkpoint, save_checkpoint
from foundry.convert import adapter_for_hf
from foundry.convert.checkpoint_io import assign_weights, meta_model
from foundry.convert.composer_pickle import read_composer_checkpoint
from foundry.convert.llmfoundry_mpt import mpt_section
from foundry.core.state import State
from foundry.core.time import Time, Timestamp
from foundry.errors import CheckpointError, ConfigError
from foundry.optim import DecoupledAdamW

_WRAPPER_PREFIX = "model."  # HuggingFaceModel keeps the wrapped model as .model
_LLM_FOUNDRY_MPT = "llmfoundry."  # the class of LLM Foundry's own MPT lives in its package
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class ComposerRun:
    """What a Composer checkpoint brings: foundry's model section and model, and optionally the run state."""

    section: dict[str, Any]
    model: nn.Module
    tokenizer_files: dict[str, str | bytes] = dataclasses.field(default_factory=dict)  # file name -> content
    timestamp: Timestamp | None = None
    optimizer: torch.optim.Optimizer | None = None
    dataloader_state: dict[str, Any] | None = None  # the train dataset's streaming state


def from_composer(path: Path, with_optimizer: bool = False) -> ComposerRun:
    """The model of Composer checkpoint ``path`` in foundry (fp32 CPU), and with ``with_optimizer`` its optimizer
    state and timestamp."""
    state = read_composer_checkpoint(path)["state"]
    hf_class, hf_config = _wrapped_model_config(path, state)
    model_state = {key.removeprefix(_WRAPPER_PREFIX): tensor for key, tensor in state["model"].items()}
    section, to_foundry = _mapping(path, hf_class, hf_config)
    model = assign_weights(meta_model(section), to_foundry(model_state), f"{path} to {section['name']}")
    run = ComposerRun(section=section, model=model, tokenizer_files=_tokenizer_files(state))
    if with_optimizer:
        run.timestamp = _timestamp(path, state)
        run.optimizer = _optimizer(path, state, model, to_foundry)
        run.dataloader_state = (state.get("dataset_state") or {}).get("train")
    return run


def _wrapped_model_config(path: Path, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    try:
        config = state["integrations"]["huggingface"]["model"]["config"]
        return str(config.get("class", "")), dict(config["content"])
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"{path} holds no Hugging Face model config (state.integrations.huggingface): it was not saved from an "
            "LLM Foundry model (hf_causal_lm, mpt_causal_lm). foundry converts those only."
        ) from None


def _tokenizer_files(state: dict[str, Any]) -> dict[str, str | bytes]:
    """The tokenizer files Composer stored, as file contents (Composer keeps .json parsed, .txt as a list of
    lines, a sentencepiece .model as its bytes). Code files (.py) are left out: foundry never runs them."""
    stored = (state.get("integrations", {}).get("huggingface", {}) or {}).get("tokenizer") or {}
    files: dict[str, str | bytes] = {}
    for name, entry in stored.items():
        extension, content = entry.get("file_extension"), entry.get("content")
        if extension == ".json":
            files[Path(name).name] = json.dumps(content, indent=2)  # a bare name: nothing lands outside the folder
        elif extension == ".txt":
            files[Path(name).name] = "\n".join(content)
        elif extension == ".model" and isinstance(content, bytes):
            files[Path(name).name] = content
    return files


def _mapping(path: Path, hf_class: str, hf_config: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(foundry model section, function from the wrapped model's state dict to foundry's)."""
    model_type = hf_config.get("model_type")
    if model_type == "mpt" and hf_class.startswith(_LLM_FOUNDRY_MPT):
        return mpt_section(path, hf_config), lambda model_state: model_state  # LLM Foundry's parameter names
    try:
        adapter = adapter_for_hf(model_type)
    except ConfigError:
        raise CheckpointError(
            f"{path} holds a {hf_class or model_type} model (model_type '{model_type}'); foundry converts LLM Foundry "
            "checkpoints of Llama, MPT and GPT-2 models. Train other models from their Hugging Face weights with "
            "`model: {name: hf_causal_lm}`."
        ) from None
    from transformers import AutoConfig

    transformers_config = AutoConfig.for_model(**hf_config)
    return adapter.from_hf_config(transformers_config), lambda state: adapter.from_hf_state_dict(
        state, transformers_config
    )


def _timestamp(path: Path, state: dict[str, Any]) -> Timestamp:
    saved = state.get("timestamp", {})
    saved = saved.get("Timestamp", saved) if isinstance(saved, dict) else {}
    try:
        counters = {name: int(saved[name]) for name in ("epoch", "batch", "sample", "token")}
        in_epoch = {f"{name}_in_epoch": int(saved.get(f"{name}_in_epoch", 0)) for name in ("batch", "sample", "token")}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path} holds no readable timestamp (state.timestamp); convert without it.") from None
    return Timestamp(**counters, **in_epoch)


def _optimizer(path: Path, state: dict[str, Any], model: nn.Module, to_foundry: Any) -> torch.optim.Optimizer:
    """A foundry DecoupledAdamW for ``model`` holding Composer's DecoupledAdamW (or AdamW) state, renamed."""
    optimizers = state.get("optimizers") or {}
    if len(optimizers) != 1:
        raise CheckpointError(f"{path} holds {len(optimizers)} optimizers; foundry converts the state of exactly one.")
    ((name, saved),) = optimizers.items()
    if name not in ("DecoupledAdamW", "AdamW"):
        raise CheckpointError(
            f"{path} holds {name} state; foundry converts DecoupledAdamW's and AdamW's (Adam moments). Convert the "
            "weights alone (without --with-optimizer) and start a fresh optimizer."
        )
    per_param = {key.removeprefix(_WRAPPER_PREFIX): value for key, value in saved["state"].items()}
    moments = {moment: to_foundry({key: value[moment] for key, value in per_param.items()}) for moment in _ADAM_MOMENTS}
    steps = {float(value["step"]) for value in per_param.values()}
    group = saved["param_groups"][0]
    hyper = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay") if key in group}
    optimizer = DecoupledAdamW(model.parameters(), **hyper)
    # The decay scales with lr / initial_lr (the schedule's peak), as in Composer's DecoupledAdamW.
    optimizer.param_groups[0]["initial_lr"] = group.get("initial_lr", group["lr"])
    for param_name, param in model.named_parameters():
        if param_name not in moments["exp_avg"]:
            raise CheckpointError(f"{path} has no optimizer state for {param_name}; convert without --with-optimizer.")
        optimizer.state[param] = {
            "step": torch.tensor(max(steps)),
            **{moment: moments[moment][param_name].clone() for moment in _ADAM_MOMENTS},
        }
    return optimizer


# ------------------------------------------------------------------------------------------ command
def add_from_composer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("composer_ckpt", help="a Composer checkpoint file (.pt) of an LLM Foundry run")
    parser.add_argument("out_ckpt", help="the save_folder to write the foundry checkpoint into (load_path)")
    parser.add_argument(
        "--with-optimizer", action="store_true", help="also the optimizer state and timestamp, to continue the run"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already there")


def run_from_composer(args: argparse.Namespace) -> int:
    path, out_ckpt = Path(args.composer_ckpt), Path(args.out_ckpt).resolve()
    if latest_checkpoint(out_ckpt) is not None and not args.overwrite:
        raise ConfigError(f"{out_ckpt} already holds a checkpoint; pass --overwrite to replace it, or choose another.")
    run = from_composer(path, with_optimizer=args.with_optimizer)
    folder = save_composer_run(run, out_ckpt, overwrite=args.overwrite)
    how = (
        "`load_path` (it continues at batch " + str(run.timestamp.batch) + ")"
        if run.timestamp
        else ("`load_path` and `load_weights_only: true`")
    )
    tokenizer = f" and its tokenizer ({out_ckpt / 'tokenizer'})" if run.tokenizer_files else " (it stored no tokenizer)"
    print(f"foundry: wrote {folder}{tokenizer} from {path}. Train from it with {how} and this model section:\n")
    print(yaml.safe_dump({"model": run.section}, sort_keys=False), end="")
    return 0


def save_composer_run(run: ComposerRun, save_folder: Path, overwrite: bool = False) -> Path:
    """Write ``run`` as a foundry checkpoint into ``save_folder``: the weights, the tokenizer (in
    ``save_folder/tokenizer``), and the optimizer, timestamp and data position."""
    state = State(model=run.model, max_duration=Time.parse("1ba"), train_dataloader=_SavedLoader(run.dataloader_state))
    if run.optimizer is not None:
        state.optimizers = [run.optimizer]
    if run.timestamp is not None:
        state.timestamp = run.timestamp
    config: dict[str, Any] = {"model": run.section}
    if run.tokenizer_files:
        tokenizer_dir = save_folder / "tokenizer"
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        for name, content in run.tokenizer_files.items():
            target = tokenizer_dir / name
            target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
        config["tokenizer"] = {"name": str(tokenizer_dir)}
    return save_checkpoint(save_folder, state, config=config, overwrite=overwrite)


@dataclasses.dataclass
class _SavedLoader:
    """Stands for the train loader of the converted run: its state is what the checkpoint records."""

    saved_state: dict[str, Any] | None

    def state_dict(self) -> dict[str, Any] | None:
        return self.saved_state
