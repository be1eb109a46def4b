"""``foundry convert to-hf CKPT OUT_DIR`` and ``foundry convert from-hf HF_DIR OUT_CKPT``."""

from __future__ import annotations

import argparse
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from foundry.checkpoint import latest_checkpoint
from foundry.convert import adapter_for_family, adapter_for_hf
from foundry.convert.checkpoint_io import empty_model, load_model_from_checkpoint, save_weights_checkpoint
from foundry.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------- to-hf
def add_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a save_folder (its latest checkpoint)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    parser.add_argument("--tokenizer", help="tokenizer to include (default: the checkpoint config's tokenizer.name)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")


def run_to_hf(args: argparse.Namespace) -> int:
    out_dir = _check_out_dir(Path(args.out_dir), args.overwrite)
    model, config, folder = load_model_from_checkpoint(args.checkpoint)
    tokenizer = _checkpoint_tokenizer(args.tokenizer, config, folder)
    hf_model = to_hf_model(model, config["model"]["name"]).to(DTYPES[args.dtype])

    def write(tmp_dir: Path) -> None:
        hf_model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)

    _write_atomically(out_dir, write)
    print(f"foundry: wrote {type(hf_model).__name__} ({args.dtype}) and its tokenizer to {out_dir} (from {folder})")
    return 0


def to_hf_model(model: nn.Module, family: str) -> nn.Module:
    """The ``transformers`` model with ``model``'s weights (shared, not copied)."""
    from transformers import AutoModelForCausalLM

    adapter = adapter_for_family(family)
    hf_config = adapter.to_hf_config(model)
    hf_state = adapter.to_hf_state_dict(model.state_dict(), model)
    with torch.device("meta"):  # no random init of weights about to be replaced
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    result = hf_model.load_state_dict(hf_state, strict=False, assign=True)
    hf_model.tie_weights()
    _rebuild_computed_buffers(hf_model)
    left_on_meta = [name for name, tensor in hf_model.state_dict().items() if tensor.is_meta]
    if result.unexpected_keys or left_on_meta:
        raise ConfigError(
            f"Export to {type(hf_model).__name__} left weights unset {left_on_meta[:5]} or unused "
            f"{result.unexpected_keys[:5]}; this is a bug in foundry/convert/{adapter.__name__.rsplit('.', 1)[-1]}.py."
        )
    return hf_model.eval()


def _rebuild_computed_buffers(hf_model: nn.Module) -> None:
    """Re-create modules whose buffers are computed from the config (RoPE frequencies), left on meta."""
    for parent in list(hf_model.modules()):
        for child_name, child in parent.named_children():
            if any(buffer.is_meta for buffer in child.buffers(recurse=False)):
                setattr(parent, child_name, type(child)(config=hf_model.config))


def _checkpoint_tokenizer(name: str | None, config: dict[str, Any], folder: Path) -> Any:
    from foundry.data import load_tokenizer

    section = config.get("tokenizer") or {}
    name = name or section.get("name")
    if not name:
        raise ConfigError(
            f"Checkpoint {folder} names no tokenizer (its config has no tokenizer.name), and an exported model "
            "must include one. Pass --tokenizer with a tokenizer directory or name."
        )
    return load_tokenizer(name, **(section.get("kwargs") or {}))


# ----------------------------------------------------------------------------------- from-hf
def add_from_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="a Hugging Face model directory (LlamaForCausalLM or MptForCausalLM)")
    parser.add_argument("out_ckpt", help="the save_folder to write the checkpoint into (load_path for training)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint there")


def run_from_hf(args: argparse.Namespace) -> int:
    hf_dir, out_ckpt = Path(args.hf_dir), Path(args.out_ckpt)
    if latest_checkpoint(out_ckpt) is not None and not args.overwrite:
        raise ConfigError(f"{out_ckpt} already holds a checkpoint; pass --overwrite to replace it, or choose another.")
    model, section = from_hf_model(hf_dir)
    config: dict[str, Any] = {"model": section}
    tokenizer = _hf_tokenizer(hf_dir)
    if tokenizer is not None:
        tokenizer_dir = out_ckpt / "tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        config["tokenizer"] = {"name": str(tokenizer_dir)}
    folder = save_weights_checkpoint(model, out_ckpt, config, overwrite=args.overwrite)
    print(f"foundry: wrote {folder} from {hf_dir}. Train from it with `load_path: {out_ckpt}`, ")
    print("`load_weights_only: true` and this model section:\n")
    print(yaml.safe_dump({"model": section}, sort_keys=False), end="")
    return 0


def from_hf_model(hf_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """(foundry model with the checkpoint's weights, its ``model:`` section)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"{hf_dir} is not a Hugging Face model directory (it has no config.json).")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    adapter = adapter_for_hf(hf_config.model_type)
    section = adapter.from_hf_config(hf_config)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = empty_model(section)
    model.load_state_dict(adapter.from_hf_state_dict(hf_model.state_dict(), hf_config), strict=True)
    return model, section


def _hf_tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    has_tokenizer = any((hf_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(hf_dir) if has_tokenizer else None


# ----------------------------------------------------------------------------------- helpers
def _check_out_dir(out_dir: Path, overwrite: bool) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} exists and is not empty; pass --overwrite to replace it, or choose another.")
    return out_dir


def _write_atomically(out_dir: Path, write: Any) -> None:
    """Run ``write(tmp_dir)`` beside ``out_dir``, then move the result into place: no half-written export."""
    tmp_dir = out_dir.parent / f".tmp-{out_dir.name}-{secrets.token_hex(4)}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
