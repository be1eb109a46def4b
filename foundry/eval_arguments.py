"""``foundry eval``'s command-line flags, apart from the command (``foundry.eval_command``) so that
``foundry eval --help`` answers without importing torch."""

from __future__ import annotations

import argparse

from foundry.core.precision_name import PRECISIONS
from foundry.icl_data import ICL_DATA_ENV


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="eval YAML (models, icl_tasks, eval_gauntlet, ...)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="set any key of the YAML")
    parser.add_argument(
        "--model", action="append", default=[], metavar="PATH", help="checkpoint, save_folder or HF directory (repeat)"
    )
    parser.add_argument(
        "--compare", nargs="+", default=[], metavar="PATH", help="models side by side, deltas vs the first"
    )
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="CKPT",
        help="LoRA checkpoints evaluated in turn on the --model base",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR|NAME",
        help="the tokenizer of every --model/--compare/--adapters model (a local tokenizer directory or a Hub name, "
        "as the train YAML's tokenizer.name), instead of the one each stores; needed where a run stored none",
    )
    parser.add_argument(
        "--tasks",
        metavar="YAML|NAME",
        help="a YAML holding icl_tasks:, or LLM Foundry's list: light, v0.3, ... (replaces the config's)",
    )
    parser.add_argument(
        "--gauntlet", metavar="YAML|NAME", help="a YAML holding eval_gauntlet:, or LLM Foundry's: v0.3, ..."
    )
    parser.add_argument(
        "--icl-data",
        metavar="DIR",
        help=f"a copy of LLM Foundry's scripts/eval folder to read task files from instead of downloading them "
        f"(same as {ICL_DATA_ENV}=DIR)",
    )
    parser.add_argument("--out", metavar="DIR", help="write results.md/.csv/.json (and compare.png) here")
    parser.add_argument(
        "--reference",
        metavar="SCORES.yaml",
        help="reference scores to compare with; prints PASS/FAIL and exits 1 on FAIL (docs/CONVERGENCE.md)",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="score only the first N rows of each task")
    parser.add_argument("--batch-size", type=int, metavar="N", help="rows per forward (device_eval_batch_size)")
    parser.add_argument("--seq-len", type=int, metavar="N", help="tokens per row (icl_seq_len)")
    parser.add_argument("--precision", choices=PRECISIONS, help="default auto: amp_bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--device", help="cpu, cuda, ... (default: this rank's GPU if any)")
    parser.add_argument(
        "--attn-impl",
        metavar="NAME",
        help="attention of Hugging Face directories: transformers' name (sdpa, eager, flash_attention_2, ...); "
        "default: sdpa where the model implements it, else eager",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="let a Hugging Face directory with its own modeling code (auto_map) run it; LLM Foundry MPT exports "
        "need no code (they load as foundry's MPT)",
    )
