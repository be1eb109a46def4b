"""LoRA out of foundry: PEFT's adapter format on the Hugging Face export of the base, and merged weights.

``foundry convert export-adapter CKPT OUT_DIR`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` so that ``peft.PeftModel.from_pretrained(hf_base, OUT_DIR)`` runs the
adapters on what ``foundry convert to-hf`` wrote for the base. Names go through the family's own
``to_hf_state_dict``: each ``lora_B`` (out × r) maps like its layer's weight, so Llama's fused
``Wqkv`` B splits by rows into q/k/v_proj while the shared ``lora_A`` is copied to each (exact).
An ``hf_causal_lm``'s adapters already carry Hugging Face's names and go out as they are.
``foundry convert merge CKPT OUT`` folds ``W + scaling · B A`` into a plain foundry checkpoint, or with ``--hf`` a
Hugging Face directory, in bf16 unless ``--dtype`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from foundry.checkpoint import latest_checkpoint, resolve_checkpoint_path
from foundry.convert import choose_export
from foundry.convert.checkpoint_io import (
    check_out_dir,
    load_checkpoint_model,
    meta_model,
    resolve_checkpoint,
    save_weights_checkpoint,
    write_atomically,
)
from foundry.errors import ConfigError
from foundry.models.lora import LoraConfig, is_adapter_key, lora_modules, merged_state_dict
from foundry.models.lora_checkpoint import has_pretrained_base, model_lora_config

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
HF_FAMILY = "hf_causal_lm"  # already a transformers model: its adapters keep their names
LoraPart = tuple[str, torch.Tensor, torch.Tensor]  # (Hugging Face module name, lora_A weight, lora_B weight)


def peft_adapter_state(model: nn.Module, family: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT's adapter tensors keyed ``base_model.model.<HF module>.lora_A.weight``, target_modules in HF names)."""
    parts, hf_linears = _hf_lora_parts(model) if family == HF_FAMILY else _converted_lora_parts(model, family)
    state: dict[str, torch.Tensor] = {}
    for hf_module, lora_a, lora_b in parts:
        state[f"{_PEFT_PREFIX}{hf_module}.lora_A.weight"] = lora_a.detach().clone().contiguous()
        state[f"{_PEFT_PREFIX}{hf_module}.lora_B.weight"] = lora_b.detach().clone().contiguous()
    return state, _hf_target_modules([hf_module for hf_module, _, _ in parts], hf_linears)


def _hf_lora_parts(model: nn.Module) -> tuple[list[LoraPart], set[str]]:
    """An ``hf_causal_lm``'s adapters: its module names already are Hugging Face's."""
    hf_model = model.hf_model
    parts = [(name, module.lora_A.weight, module.lora_B.weight) for name, module in lora_modules(hf_model)]
    return parts, {name for name, module in hf_model.named_modules() if isinstance(module, nn.Linear)}


def _converted_lora_parts(model: nn.Module, family: str) -> tuple[list[LoraPart], set[str]]:
    """A native family's adapters under the names ``foundry convert to-hf`` gives their layers."""
    adapter = choose_export(model, family).adapter  # a base that cannot be exported fails here, naming why
    is_transposed = getattr(adapter, "is_transposed", lambda hf_name: False)  # GPT-2's Conv1D: (in, out) weights
    parts: list[LoraPart] = []
    for name, module in lora_modules(model):
        # The B rows map exactly as the weight's rows do (e.g. Wqkv -> q, k, v); A is each part's A.
        b_parts = adapter.to_hf_state_dict({f"{name}.weight": module.lora_B.weight.detach()}, model)
        b_parts = {hf_name: b.t() if is_transposed(hf_name) else b for hf_name, b in b_parts.items()}
        parts += [(hf_name.removesuffix(".weight"), module.lora_A.weight, b) for hf_name, b in b_parts.items()]
    weights = {name: tensor for name, tensor in model.state_dict().items() if not is_adapter_key(name)}
    linear_weights = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    hf_linears = adapter.to_hf_state_dict({name: weights[name] for name in linear_weights & set(weights)}, model)
    return parts, {name.removesuffix(".weight") for name in hf_linears}


def _hf_target_modules(hf_modules: list[str], hf_linears: set[str]) -> list[str]:
    """Short names (``q_proj``) when PEFT's suffix match of them picks exactly the adapted modules, else full names."""
    short = sorted({name.rpartition(".")[2] for name in hf_modules})
    picked_by_short = {name for name in hf_linears if name.rpartition(".")[2] in short}
    return short if picked_by_short == set(hf_modules) else sorted(hf_modules)


def adapter_config(
    config: LoraConfig, target_modules: list[str], base_model_name_or_path: str, fan_in_fan_out: bool = False
) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``config``."""
    return {
        "peft_type": "LORA",
        "task_type": config.task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": target_modules,
        "bias": config.bias,
        "use_rslora": config.use_rslora,
        "fan_in_fan_out": fan_in_fan_out,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_adapter(model: nn.Module, family: str, out_dir: Path, base_model_name_or_path: str) -> Path:
    """Write ``model``'s adapters in PEFT's format to ``out_dir``."""
    config = model_lora_config(model)
    if config is None:
        raise ConfigError("This model has no LoRA adapters (its model section has no peft_config); nothing to export.")
    state, target_modules = peft_adapter_state(model, family)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    fan_in_fan_out = family != HF_FAMILY and hasattr(choose_export(model, family).adapter, "is_transposed")
    payload = adapter_config(config, target_modules, base_model_name_or_path, fan_in_fan_out)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------- commands
def add_export_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a LoRA run's checkpoint folder, or its save_folder (the latest)")
    parser.add_argument("out_dir", help="the PEFT adapter directory to write")
    parser.add_argument(
        "--base-model",
        help="adapter_config.json's base_model_name_or_path: the `foundry convert to-hf` directory of the base "
        "(default: the run's load_path; for hf_causal_lm without one, its pretrained_model_name_or_path)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")


def run_export_adapter(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(Path(args.out_dir), args.overwrite)
    folder, config = resolve_checkpoint(args.checkpoint)
    family = config["model"]["name"]
    _require_lora(config["model"], folder)
    model = load_checkpoint_model(folder, config["model"], with_base=False)  # the adapters are all an export reads
    base = args.base_model or default_base_model(config)
    write_atomically(out_dir, lambda tmp_dir: write_peft_adapter(model, family, tmp_dir, base))
    print(f"foundry: wrote the LoRA adapters of {folder} in PEFT's format to {out_dir} (base: {base or 'unset'})")
    return 0


def default_base_model(config: dict[str, Any]) -> str:
    """The base an exported adapter names: the run's load_path, or an hf_causal_lm's own pretrained model."""
    if not config.get("load_path") and has_pretrained_base(config["model"]):
        return str(config["model"]["pretrained_model_name_or_path"])
    return str(config.get("load_path") or "")


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    from foundry.convert.commands import DTYPES  # transformers: imported by the command, not by the Trainer

    parser.add_argument("checkpoint", help="a LoRA run's checkpoint folder, or its save_folder (the latest)")
    parser.add_argument(
        "out", help="the save_folder to write the merged checkpoint into; with --hf, the Hugging Face directory"
    )
    parser.add_argument(
        "--hf", action="store_true", help="write a Hugging Face model directory that transformers loads alone"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16",
        help="the merged weights' dtype (default bf16: W + scaling·BA is summed in fp32, then rounded once)",
    )  # fmt: skip
    parser.add_argument("--tokenizer", help="with --hf: the tokenizer to include (default: the run's tokenizer.name)")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint or directory already there")


def run_merge(args: argparse.Namespace) -> int:
    from foundry.convert.commands import DTYPES, checkpoint_tokenizer, write_hf_folder

    out = Path(args.out).resolve()
    if args.hf:
        check_out_dir(out, args.overwrite)
    elif latest_checkpoint(out) is not None and not args.overwrite:
        raise ConfigError(f"{out} already holds a checkpoint; pass --overwrite to replace it, or choose another.")
    folder, config = resolve_checkpoint(args.checkpoint)
    _require_lora(config["model"], folder)
    tokenizer = checkpoint_tokenizer(args.tokenizer, config, folder) if args.hf else None  # before any weight is read
    model = load_lora_checkpoint(folder, config["model"])
    merged, section = merged_model(model, config["model"], DTYPES[args.dtype])
    del model  # a 70B model's fp32 LoRA copy need not outlive the merge
    if args.hf:
        description = write_hf_folder(merged, section, tokenizer, out, DTYPES[args.dtype], folder)
        written = f"{out}: {description}, {args.dtype}, and its tokenizer"
    else:
        merged_config = {"model": section, **({"tokenizer": config["tokenizer"]} if "tokenizer" in config else {})}
        written = f"{save_weights_checkpoint(merged, out, merged_config, overwrite=args.overwrite)} ({args.dtype})"
    print(f"foundry: wrote {written}: the weights of {folder} with its LoRA adapters merged in (no peft_config).")
    return 0


def load_lora_checkpoint(folder: Path, section: dict[str, Any]) -> nn.Module:
    """The LoRA model of checkpoint ``folder`` on CPU; an adapters-only checkpoint's base is read first."""
    return load_checkpoint_model(resolve_checkpoint_path(folder), section)


def merged_model(
    model: nn.Module, section: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """(the plain model computing ``model``'s function with adapters folded in, in ``dtype``; its model section).

    Each merged weight is summed in fp32 and rounded to ``dtype`` once, as it is copied in.
    """
    plain_section = {key: value for key, value in section.items() if key != "peft_config"}
    plain = meta_model(plain_section).to(dtype).to_empty(device="cpu")  # cast on meta: no fp32 copy is allocated
    plain.load_state_dict(merged_state_dict(model, dtype))
    return plain.eval(), plain_section


def _require_lora(section: dict[str, Any], folder: Path) -> None:
    if not section.get("peft_config"):
        raise ConfigError(
            f"Checkpoint {folder} is not a LoRA run (its model section has no peft_config); export it whole with "
            "`foundry convert to-hf`."
        )
