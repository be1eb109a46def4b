"""``foundry eval --model BASE --adapters A B C --tasks T.yaml``: several LoRA adapters on one loaded base.

The base checkpoint is read once into the adapters' LoRA model; each adapter's tensors are kept
beside it (``AdapterSet``) and copied in before its tasks run, so no switch reloads the base. The
median switch time is printed with the results.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from foundry.checkpoint import load_checkpoint
from foundry.convert.checkpoint_io import check_weights_loaded, resolve_checkpoint, unloaded_model
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import ConfigError
from foundry.eval.loading import LoadedModel, _max_seq_len, _tokenizer, is_hf_directory
from foundry.eval.runner import build_evaluator, score
from foundry.models.build import build_model
from foundry.models.lora import is_adapter_key
from foundry.peft.adapters import AdapterSet
from foundry.peft.export import HF_FAMILY


def _base_model(base: Path, section: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(the adapters' LoRA model holding ``base``'s weights on CPU, the base's tokenizer section).

    ``base`` is a foundry checkpoint, or for an ``hf_causal_lm`` run a Hugging Face directory.
    """
    if is_hf_directory(base):
        if section.get("name") != HF_FAMILY:
            raise ConfigError(
                f"--model {base} is a Hugging Face directory, but the adapters' run is a {section.get('name')}: "
                "pass its base as a foundry checkpoint (the run's load_path)."
            )
        model = build_model({**section, "pretrained_model_name_or_path": str(base), "pretrained": True})
        has_tokenizer = any((base / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
        return model, {"name": str(base)} if has_tokenizer else None
    base_folder, base_config = resolve_checkpoint(base)
    model = unloaded_model(section)
    load_checkpoint(base_folder, State(model=model, max_duration=Time.parse("1ba")), weights_only=True)
    check_weights_loaded(model, f"Base checkpoint {base_folder}", ignore=is_adapter_key)  # adapters: switched in
    return model, base_config.get("tokenizer")


def evaluate_adapters(
    bases: list[Any], adapter_paths: list[str], tasks: list, gauntlet: Any, cfg: Any, device: Any
) -> list:
    """``ModelResults`` per adapter (named by its path), all on the one base in ``bases``."""
    if len(bases) != 1 or not isinstance(bases[0], str | Path):
        raise ConfigError("--adapters needs exactly one base checkpoint: pass it as --model BASE (no --compare).")
    _, adapter_config = resolve_checkpoint(adapter_paths[0])
    section = adapter_config["model"]
    if not section.get("peft_config"):
        raise ConfigError(f"{adapter_paths[0]} is not a LoRA run (its model section has no peft_config).")
    model, base_tokenizer = _base_model(Path(bases[0]), section)
    model = model.to(device).eval()
    given = {"name": str(cfg.tokenizer)} if cfg.tokenizer else None
    tokenizer_section = given or base_tokenizer or adapter_config.get("tokenizer")
    if tokenizer_section is None:
        raise ConfigError(
            f"Neither {bases[0]} nor {adapter_paths[0]} names a tokenizer in its config. Pass the one they were "
            "trained with: --tokenizer DIR_OR_NAME."
        )
    evaluator = build_evaluator(
        LoadedModel("base", model, _tokenizer(tokenizer_section), _max_seq_len(model)), tasks, cfg
    )
    adapters = AdapterSet(model)
    for path in adapter_paths:
        adapters.load(path, path)
    results, switch_s = [], []
    for name in adapters.names:
        switch_s.append(adapters.activate(name))
        results.append(score(evaluator, model, name, gauntlet, cfg, device))
    print(
        f"foundry: {len(adapters.names)} adapters on one base ({bases[0]}); adapter switch median "
        f"{statistics.median(switch_s) * 1000:.3f} ms"
    )
    return results
