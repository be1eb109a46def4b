"""``foundry eval``: ICL tasks on checkpoints, save_folders and Hugging Face directories, as one table.

    foundry eval --model runs/quickstart/checkpoints --tasks light     # LLM Foundry's tasks_light, fetched once
    foundry eval --compare REFERENCE_HF_DIR runs/mine/checkpoints --tasks T.yaml --gauntlet G.yaml --out cmp/
    foundry eval yamls/eval/eval_quickstart.yaml [key.path=value ...]      # LLM Foundry's eval YAML keys

Under torchrun each rank scores a share of every task; rank 0 prints and writes the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import field
from pathlib import Path
from typing import Any

import torch

from foundry import distributed
from foundry.core import seed_everything
from foundry.core.paths import is_object_store_url
from foundry.core.precision import Precision, check_precision
from foundry.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from foundry.eval.adapters import evaluate_adapters
from foundry.eval.loading import build_model_entry, check_model_path, load_model
from foundry.eval.reference import deltas, load_references, reference_table, verdict
from foundry.eval.report import markdown_table, write_reports
from foundry.eval.runner import build_evaluator, score
from foundry.eval.task_config import parse_gauntlet, parse_icl_tasks
from foundry.eval.tasks import local_task_files
from foundry.icl_data import ICL_DATA_ENV
from foundry.yaml_config import load_config


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """What ``foundry eval CONFIG.yaml`` reads (LLM Foundry's ``scripts/eval`` keys that apply here)."""

    models: list[dict[str, Any]] = field(default_factory=list)  # each: model_name, model, tokenizer, load_path
    icl_tasks: str | list[dict[str, Any]] | None = None
    eval_gauntlet: str | dict[str, Any] | None = None
    icl_seq_len: int | None = None  # default: max_seq_len, else the model's own
    max_seq_len: int | None = None
    device_eval_batch_size: int = 8
    precision: Precision = Precision.AUTO  # amp_bf16 on a GPU, fp32 on a CPU
    device: str | None = None
    seed: int = 17
    max_examples: int | None = None  # score only the first N rows of each task (quick checks)
    progress_bar: bool = True
    run_name: str | None = None
    attn_implementation: str | None = None  # Hugging Face directories; None: sdpa where implemented, else eager
    trust_remote_code: bool = False  # Hugging Face directories that ship their own modeling code may run it
    tokenizer: str | None = None  # --model/--compare models' tokenizer (directory or Hub name); None: their own


def load_eval_config(args: argparse.Namespace) -> EvalConfig:
    """The YAML (if any) with overrides, then the command-line flags on top."""
    if args.icl_data:  # through the environment, so that torchrun's ranks read the same copy
        os.environ[ICL_DATA_ENV] = args.icl_data
    cfg, _ = load_config(EvalConfig, args.config, args.overrides)
    flags = {
        "icl_tasks": args.tasks,
        "eval_gauntlet": args.gauntlet,
        "max_examples": args.limit,
        "device_eval_batch_size": args.batch_size,
        "icl_seq_len": args.seq_len,
        "precision": args.precision,
        "device": args.device,
        "attn_implementation": args.attn_impl,
        "trust_remote_code": args.trust_remote_code,
        "tokenizer": args.tokenizer,
    }
    cfg = dataclasses.replace(cfg, **{key: value for key, value in flags.items() if value is not None})
    if cfg.icl_tasks is None:
        raise ConfigError(
            "No ICL tasks: pass --tasks TASKS.yaml (a file with icl_tasks:) or set icl_tasks in the YAML."
        )
    if not cfg.models and not args.model and not args.compare:
        raise ConfigError("No model to evaluate: pass --model PATH, --compare A B, or list models: in the YAML.")
    return cfg


def run_eval(args: argparse.Namespace) -> int:
    cfg = load_eval_config(args)
    references = load_references(args.reference) if args.reference else []  # checked before a model loads
    for path in [*args.model, *args.compare, *args.adapters]:  # before any task file is fetched
        check_model_path(path)
    tasks = local_task_files(parse_icl_tasks(cfg.icl_tasks))  # every key and file checked (fetched) before a model
    gauntlet = parse_gauntlet(cfg.eval_gauntlet) if cfg.eval_gauntlet is not None else None
    if distributed.launched_by_torchrun():
        distributed.init_process_group()
    try:
        device = torch.device(cfg.device) if cfg.device else distributed.default_device()
        cfg = dataclasses.replace(cfg, precision=check_precision(cfg.precision, device))
        seed_everything(cfg.seed)
        sources = [*((entry, f"models[{i}]") for i, entry in enumerate(cfg.models)), *args.model, *args.compare]
        if args.adapters:  # one base, several LoRA adapters switched in place (foundry.eval.adapters)
            results = evaluate_adapters(sources, args.adapters, tasks, gauntlet, cfg, device)
        else:
            results = [evaluate_source(source, tasks, gauntlet, cfg, device) for source in sources]
    finally:
        distributed.destroy_process_group()
    passed = [verdict(deltas(model_results, reference))[0] for model_results in results for reference in references]
    if distributed.get_rank() == 0:
        compare = bool(args.compare)
        print(markdown_table(results, deltas=compare), end="")
        for model_results in results:
            for reference in references:
                print("\n" + reference_table(model_results, reference), end="")
        if args.out:
            for path in write_reports(results, args.out, deltas=compare):
                print(f"foundry: wrote {path}", file=sys.stderr)
        if passed:
            word = "PASS" if all(passed) else "FAIL"
            print(f"\n{word}: {passed.count(True)} of {len(passed)} reference checks passed")
    return EXIT_OK if all(passed) else EXIT_CHECK_FAILED


def evaluate_source(source: Any, tasks: list, gauntlet: Any, cfg: EvalConfig, device: Any) -> Any:
    """Load one model (a path, or a ``(models entry, key path)`` pair), evaluate it, free it."""
    if isinstance(source, tuple):
        loaded = build_model_entry(*source)
    else:
        loaded = load_model(
            source,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            tokenizer=cfg.tokenizer,
        )
    evaluator = build_evaluator(loaded, tasks, cfg)  # foundry.eval.runner
    model = loaded.model.to(device)
    results = score(evaluator, model, loaded.name, gauntlet, cfg, device)
    del model, loaded
    return dataclasses.replace(results, name=display_name(source))


def display_name(source: Any) -> str:
    if isinstance(source, tuple):
        entry = source[0]
        return str(entry.get("model_name") or entry["model"].get("name"))
    return source if is_object_store_url(source) else str(Path(source))  # Path() would make s3:// into s3:/
