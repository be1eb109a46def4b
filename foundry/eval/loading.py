"""Models to evaluate: a foundry checkpoint, a save_folder (its latest checkpoint), or a Hugging Face directory.

A foundry checkpoint's ``meta.json`` holds the resolved train config, which rebuilds the model and
its tokenizer; a Hugging Face directory (``config.json``) loads through ``hf_causal_lm``, except LLM
Foundry's MPT exports, which load as foundry's ``mpt_causal_lm`` (``foundry.convert.llmfoundry_mpt``), and
the mixtures of experts foundry converts (Mixtral, OLMoE, Qwen3-MoE, DBRX: ``foundry.models.hf_families.NATIVE_MOE``),
which load as foundry's own MoE.
A folder that ships other modeling code of its own loads only with ``trust_remote_code``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from foundry.convert.checkpoint_io import (
    check_model_path,
    load_checkpoint_model,
    resolve_checkpoint,
    resolve_checkpoint_path,
)
from foundry.convert.commands import from_hf_model
from foundry.convert.foundry_mpt import is_foundry_export
from foundry.convert.llmfoundry_mpt import is_llm_foundry_mpt_export, load_export_tokenizer, load_llm_foundry_export
from foundry.core.paths import is_object_store_url
from foundry.data import load_tokenizer
from foundry.data.config import TokenizerConfig
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.models.hf import HFCausalLM, hf_context_length
from foundry.models.hf_families import NATIVE_MOE
from foundry.schema import parse_dataclass


@dataclasses.dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: Any
    max_seq_len: int | None  # the model's context length, when it states one


def load_model(
    path: str | Path,
    name: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: Any = None,
) -> LoadedModel:
    """The model (on CPU, weights loaded) and tokenizer stored at ``path``.

    ``tokenizer`` (a tokenizer, or a directory or Hub name) replaces the stored one. A foundry checkpoint
    whose run had no tokenizer (pre-tokenized batches) loads with tokenizer None; what needs one (ICL
    eval, generation) says so.

    ``attn_implementation`` applies to Hugging Face directories (transformers' names: ``sdpa``, ``eager``,
    ...; None picks ``sdpa`` where the model's class implements it, else ``eager``); a foundry
    checkpoint's attention is its config's. ``trust_remote_code`` lets a Hugging Face directory that
    ships its own modeling code (``auto_map`` in config.json) run it; without it such a directory is
    refused, except an LLM Foundry MPT export, which loads as foundry's MPT without running any of it.
    """
    if not is_object_store_url(str(path)):  # a URL is resolved (downloaded) as given: Path() would mangle it
        check_model_path(path)
        path = Path(path).expanduser()
        if is_hf_directory(path):
            loaded = _load_hf_directory(path, name or path.name, attn_implementation, trust_remote_code)
            return dataclasses.replace(loaded, tokenizer=_given_tokenizer(tokenizer) or loaded.tokenizer)

    folder, config = resolve_checkpoint(path)
    model = load_checkpoint_model(folder, config["model"])
    stored = config.get("tokenizer")
    given = _given_tokenizer(tokenizer)
    if given is None and isinstance(stored, Mapping):
        given = _tokenizer(stored)
    return LoadedModel(name or _checkpoint_name(Path(path), folder), model, given, _max_seq_len(model))


def _given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer passed as an object, or loaded from its directory or Hub name."""
    return _tokenizer({"name": str(tokenizer)}) if isinstance(tokenizer, (str, Path)) else tokenizer


def require_tokenizer(loaded: LoadedModel, purpose: str) -> Any:
    """``loaded.tokenizer``, or an error saying how to give one: a checkpoint from pre-tokenized batches has none."""
    if loaded.tokenizer is None:
        raise ConfigError(
            f"{loaded.name} has no tokenizer (its run's config names no tokenizer.name: it trained on pre-tokenized "
            f"batches), so it cannot {purpose}. Pass the tokenizer it was trained with: `foundry eval --tokenizer "
            "DIR_OR_NAME ...` (a tokenizer directory or Hub name, as the train YAML's tokenizer.name takes); in "
            "Python, foundry.load_model(path, tokenizer=DIR_OR_NAME)."
        )
    return loaded.tokenizer


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face model directory (config.json), not a foundry checkpoint (meta.json)."""
    return (path / "config.json").is_file() and not (path / "meta.json").is_file()


def build_model_entry(entry: Mapping[str, Any], key_path: str) -> LoadedModel:
    """An eval YAML ``models:`` entry (LLM Foundry's: model_name, model, tokenizer, load_path)."""
    unknown = set(entry) - {"model_name", "model", "tokenizer", "load_path"}
    if unknown or "model" not in entry or "tokenizer" not in entry:
        raise ConfigError(
            f"'{key_path}' needs 'model' and 'tokenizer' (and optionally 'model_name', 'load_path'); "
            f"got keys {', '.join(map(str, entry))}."
        )
    name = entry.get("model_name") or entry["model"].get("name")
    tokenizer = _tokenizer(entry["tokenizer"])
    if entry.get("load_path"):
        model = load_checkpoint_model(resolve_checkpoint_path(entry["load_path"]), entry["model"])
    else:
        model = build_model(entry["model"], tokenizer)
    return LoadedModel(str(name), model, tokenizer, _max_seq_len(model))


def _load_hf_directory(path: Path, name: str, attn_implementation: str | None, trust_remote_code: bool) -> LoadedModel:
    raw_config = json.loads((path / "config.json").read_text())
    if is_llm_foundry_mpt_export(raw_config) or is_foundry_export(raw_config):  # foundry's MPT, their code never runs
        model, _ = load_llm_foundry_export(path) if is_llm_foundry_mpt_export(raw_config) else from_hf_model(path)
        has_tokenizer = (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        return LoadedModel(
            name, model.eval(), load_export_tokenizer(path) if has_tokenizer else None, _max_seq_len(model)
        )
    if raw_config.get("model_type") in NATIVE_MOE and not raw_config.get("auto_map"):
        model, _ = from_hf_model(path)  # foundry's MoE: grouped experts, not transformers' loop over them
        return LoadedModel(name, model.eval(), _tokenizer({"name": str(path)}), _max_seq_len(model))
    model = HFCausalLM(
        pretrained_model_name_or_path=str(path),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    tokenizer = _tokenizer({"name": str(path)})
    return LoadedModel(name, model, tokenizer, hf_context_length(model.hf_config))


def _tokenizer(section: Mapping[str, Any]) -> Any:
    cfg = parse_dataclass(TokenizerConfig, section, "tokenizer")
    return load_tokenizer(cfg.name, **cfg.kwargs)


def _max_seq_len(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "max_seq_len", None)
    if isinstance(value, int):
        return value
    hf_config = getattr(model, "hf_config", None)
    return hf_context_length(hf_config) if hf_config is not None else None


def _checkpoint_name(given: Path, folder: Path) -> str:
    """``run/ep0-ba200`` style: the folder a user recognises."""
    return f"{given.name}/{folder.name}" if given != folder else f"{folder.parent.name}/{folder.name}"
