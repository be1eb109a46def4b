"""``foundry convert to-hf CKPT OUT_DIR`` and ``foundry convert from-hf HF_DIR OUT_CKPT``."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from foundry.checkpoint import latest_checkpoint
from foundry.checkpoint.hf_weights import layers_of_folder
from foundry.convert import adapter_for_hf, choose_export, foundry_mpt
from foundry.convert.checkpoint_io import (
    assign_weights,
    check_out_dir,
    load_checkpoint_model,
    meta_model,
    nothing_at,
    resolve_checkpoint,
    save_weights_checkpoint,
    stream_into,
    write_atomically,
)
from foundry.convert.hf_export import export_hf_model, exported_section, fit_state, save_hf_folder
from foundry.convert.llmfoundry_mpt import is_llm_foundry_mpt_export, load_export_tokenizer, load_llm_foundry_export
from foundry.data import load_tokenizer
from foundry.errors import ConfigError

HF_CAUSAL_LM = "hf_causal_lm"  # already a transformers model: exported as it is
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------- to-hf
def add_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a save_folder (its latest checkpoint)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    parser.add_argument("--tokenizer", help="tokenizer to include (default: the checkpoint config's tokenizer.name)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")


def run_to_hf(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(Path(args.out_dir), args.overwrite)
    folder, config = resolve_checkpoint(args.checkpoint)
    family = config["model"]["name"]
    _refuse_lora(config["model"], folder)
    tokenizer = checkpoint_tokenizer(args.tokenizer, config, folder)
    if family != HF_CAUSAL_LM:  # an unexportable model fails before any weight is read
        choose_export(meta_model(config["model"]), family)
    model = load_checkpoint_model(folder, config["model"])
    description = write_hf_folder(model, config["model"], tokenizer, out_dir, DTYPES[args.dtype], folder)
    print(f"foundry: wrote {description}, {args.dtype}, and its tokenizer to {out_dir} (from {folder})")
    return 0


def write_hf_folder(
    model: nn.Module, section: dict[str, Any], tokenizer: Any, out_dir: Path, dtype: torch.dtype, source: Path
) -> str:
    """Write ``model`` (of ``section``, read from checkpoint ``source``) as a Hugging Face model directory in
    ``dtype`` with ``tokenizer``, all at once; returns the exported class's description."""
    export = export_hf_model(model, section["name"], section=section)
    hf_model = export.hf_model.to(dtype)
    if len(tokenizer) > hf_model.config.vocab_size:
        raise ConfigError(
            f"The tokenizer has {len(tokenizer)} tokens but the model in {source} embeds only "
            f"{hf_model.config.vocab_size} (model.vocab_size), so the export could not read every token it writes. "
            "Pass --tokenizer with the tokenizer the model was trained with."
        )
    set_special_token_ids(hf_model, tokenizer)
    tokenizer.model_input_names = [name for name in tokenizer.model_input_names if name != "token_type_ids"]
    write_atomically(out_dir, lambda tmp_dir: save_hf_folder(hf_model, tmp_dir, tokenizer))
    return export.description


def set_special_token_ids(hf_model: nn.Module, tokenizer: Any) -> None:
    """The tokenizer's BOS/EOS/PAD ids in the model's config.json and generation_config.json.

    transformers' config classes carry their own defaults (LlamaConfig: bos 1, eos 2; MptConfig: none),
    which ``generate`` would use: with another tokenizer it would stop at the wrong token or never.
    A tokenizer without BOS or EOS writes ``null`` rather than another id.
    """
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in ids.items():
        setattr(hf_model.config, key, value)
    hf_model.generation_config = GenerationConfig(**ids)


def _refuse_lora(section: dict[str, Any], folder: Path) -> None:
    """A LoRA run's model is not a transformers architecture: its adapters go out merged or in PEFT's format."""
    if section.get("peft_config"):
        raise ConfigError(
            f"Checkpoint {folder} is a LoRA run (its model section has model.peft_config), which to-hf does not "
            f"export as it is. Fold the adapters into the weights: `foundry convert merge {folder} OUT_DIR --hf` "
            "writes the merged model as a Hugging Face directory; or export the adapters in PEFT's format with "
            f"`foundry convert export-adapter {folder} OUT_DIR` (docs/LORA.md)."
        )


def checkpoint_tokenizer(name: str | None, config: dict[str, Any], folder: Path) -> Any:
    section = config.get("tokenizer") or {}
    if not (name or section.get("name")):
        raise ConfigError(
            f"Checkpoint {folder} names no tokenizer (its config has no tokenizer.name), and an exported model "
            "must include one. Pass --tokenizer with a tokenizer directory or name."
        )
    return load_tokenizer(name or section["name"], **({} if name else section.get("kwargs") or {}))


# ----------------------------------------------------------------------------------- from-hf
def add_from_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "hf_dir",
        help="a Hugging Face model directory (LlamaForCausalLM, MptForCausalLM, GPT2LMHeadModel, a foundry export "
        "or LLM Foundry's MPT export)",
    )
    parser.add_argument("out_ckpt", help="the save_folder to write the checkpoint into (load_path for training)")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already there")


def run_from_hf(args: argparse.Namespace) -> int:
    hf_dir, out_ckpt = Path(args.hf_dir), Path(args.out_ckpt).resolve()
    if latest_checkpoint(out_ckpt) is not None and not args.overwrite:
        raise ConfigError(f"{out_ckpt} already holds a checkpoint; pass --overwrite to replace it, or choose another.")
    model, section = from_hf_model(hf_dir)
    config: dict[str, Any] = {"model": section}
    tokenizer = _hf_tokenizer(hf_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_ckpt / "tokenizer")
        config["tokenizer"] = {"name": str(out_ckpt / "tokenizer")}
    folder = save_weights_checkpoint(model, out_ckpt, config, overwrite=args.overwrite)
    print(
        f"foundry: wrote {folder} from {hf_dir}"
        f"{' with its tokenizer' if tokenizer is not None else ' (no tokenizer found there)'}. Train from it with "
        f"`load_path: {out_ckpt}`, `load_weights_only: true` and this model section:\n"
    )
    print(yaml.safe_dump({"model": section}, sort_keys=False), end="")
    return 0


def from_hf_model(hf_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """(foundry model holding the checkpoint's weights in fp32, its ``model:`` section)."""
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(_not_a_hf_directory(hf_dir))
    raw_config = json.loads((hf_dir / "config.json").read_text())
    if is_llm_foundry_mpt_export(raw_config):
        return load_llm_foundry_export(hf_dir)
    if foundry_mpt.is_foundry_export(raw_config):  # foundry's own code: read, never run
        section = foundry_mpt.from_hf_config(raw_config)
        return _imported_model(raw_config, foundry_mpt, section, lambda layer: layer, hf_dir)
    if raw_config.get("auto_map"):
        raise ConfigError(
            f"{hf_dir / 'config.json'} names its own modeling code (auto_map: {raw_config['auto_map']}), which "
            "foundry does not run and which a built-in class of the same model_type would not compute. foundry "
            "convert from-hf reads transformers' built-in classes (Llama, MPT, GPT-2), foundry's own exports and LLM "
            "Foundry's MPT exports; train "
            "this model as `model: {name: hf_causal_lm, pretrained_model_name_or_path: <dir>, trust_remote_code: "
            "true}` if you trust its code."
        )
    try:  # never runs a checkpoint's own code: the adapters know transformers' built-in classes only
        hf_config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    except (ValueError, OSError) as error:
        remote = "trust_remote_code" in str(error)
        reason = "the model needs its own Python code, which foundry does not run" if remote else str(error).strip()
        raise ConfigError(
            f"transformers cannot read {hf_dir / 'config.json'} with its built-in classes: {reason}. foundry convert "
            "from-hf reads Llama, MPT and GPT-2 checkpoints; train any other causal LM with "
            "`model: {name: hf_causal_lm}`."
        ) from None
    adapter = adapter_for_hf(hf_config.model_type)
    section = adapter.from_hf_config(hf_config)
    convert = functools.partial(adapter.from_hf_state_dict, hf_config=hf_config)
    return _imported_model(raw_config, adapter, section, convert, hf_dir)


def _not_a_hf_directory(hf_dir: Path) -> str:
    """What ``hf_dir`` is, since it has no config.json, and what to pass instead."""
    if not hf_dir.exists():
        reads = "foundry convert from-hf reads a Hugging Face model directory on disk (config.json and the weights)."
        return nothing_at(str(hf_dir), reads, then="run `foundry convert from-hf {folder} OUT`")
    if hf_dir.is_dir() and (latest_checkpoint(hf_dir) is not None or (hf_dir / "meta.json").is_file()):
        return (
            f"{hf_dir} is a foundry checkpoint (or a save_folder), not a Hugging Face directory: it needs no "
            f"conversion. Train from it with `load_path: {hf_dir}`, or evaluate it with `foundry eval --model`."
        )
    holds = ""
    if hf_dir.is_dir():
        files = sorted(path.name for path in hf_dir.iterdir())
        holds = f" (it holds {', '.join(files[:8])}{', ...' if len(files) > 8 else ''})" if files else " (it is empty)"
    return (
        f"{hf_dir} has no config.json, so it is not a Hugging Face model directory{holds}. "
        "Pass the folder that holds config.json and the weights (*.safetensors): in the Hub's cache that is "
        "models--ORG--NAME/snapshots/<revision>/; or download the model to a folder of its own with `hf download "
        "ORG/NAME --local-dir DIR` and pass DIR."
    )


def _imported_model(
    raw_config: dict[str, Any],
    adapter: Any,
    section: dict[str, Any],
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    hf_dir: Path,
) -> tuple[nn.Module, dict[str, Any]]:
    """The model foundry exported to ``hf_dir`` when config.json records it (the same family and keys), else
    the one ``section`` describes, filled a layer at a time (``foundry.checkpoint.hf_weights``): host memory holds the
    model and one layer of the checkpoint, never a second copy of it."""
    recorded = exported_section(raw_config, adapter, section)
    model = meta_model(recorded or section)
    if recorded is not None:  # its own zero biases the recorded model lacks are left out
        convert = (lambda adapted: lambda layer: fit_state(adapted(layer), model))(convert)
    source = f"{hf_dir} to {(recorded or section)['name']}"
    stream_into(model, layers_of_folder(hf_dir), convert, source)
    return assign_weights(model, {}, source), recorded or section


def _hf_tokenizer(hf_dir: Path) -> Any:
    has_tokenizer = any((hf_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    if not has_tokenizer:
        return None
    raw_config = json.loads((hf_dir / "config.json").read_text())
    if is_llm_foundry_mpt_export(raw_config) or foundry_mpt.is_foundry_export(raw_config):  # no built-in config
        return load_export_tokenizer(hf_dir)
    return AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)


# ----------------------------------------------------------------------------------- helpers
