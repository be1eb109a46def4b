"""The largest finetuning YAMLs as shipped, on random weights: tokens/s per GPU, MFU and peak memory per row.

Here, once (4,096-token MDS samples of the shared corpora and the gpt-neox-20b tokenizer; the GPU machine has no
network, so the data travels with the checkout):

    python benchmarks/largest_models.py prepare --out data/largest_models

On the GPU machine, one row a call (each row is its own ``foundry train --nproc N`` process group, stopped at
``--row-timeout``; its JSON is written when it ends, so a row that runs out of memory or time loses no other):

    python benchmarks/largest_models.py run --data data/largest_models --out OUT_DIR --rows llama-70b-qlora

=================  =========================================  ====
row                YAML                                        GPUs
=================  =========================================  ====
llama-70b-qlora    yamls/finetune/llama-70b-qlora.yaml            2
llama-70b-lora     yamls/finetune/llama-70b-lora.yaml             4
llama-405b-qlora   yamls/finetune/llama-405b-qlora.yaml           4
=================  =========================================  ====

Every row trains ``--batches`` batches (``--warmup`` of them left out of the averages) with
``load_path= model.peft_config.save_adapters_only=false save_folder=`` (random weights, nothing saved) and the
text loader over the prepared samples in place of the YAML's jsonl; everything else is the YAML's.
``run --smoke`` runs each row's YAML with a tiny Llama (256 wide) on two gloo ranks of this CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import REPO_ROOT, SHARED_DATA, environment, foundry_train, markdown_table, prepare_and_run_parsers
from default_path import build_data, run_metrics

FINETUNE = REPO_ROOT / "yamls" / "finetune"
ROWS: dict[str, tuple[Path, int]] = {  # name: (YAML, GPUs)
    "llama-70b-qlora": (FINETUNE / "llama-70b-qlora.yaml", 2),
    "llama-70b-lora": (FINETUNE / "llama-70b-lora.yaml", 4),
    "llama-405b-qlora": (FINETUNE / "llama-405b-qlora.yaml", 4),
}
SEQ_LEN = 4096
RANDOM_WEIGHTS = ["load_path=", "model.peft_config.save_adapters_only=false", "save_folder=", "eval_loader=null"]
SMOKE = [
    "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.kv_n_heads=2", "model.ffn_hidden_size=512",
    "model.vocab_size=50304", "variables.max_seq_len=128", "global_train_batch_size=2",
    "fsdp_config.mixed_precision=DEFAULT",
]  # fmt: skip
SMOKE_NPROC = 2  # gloo ranks on the CPU
SMOKE_SEQ_LEN = 128  # the loader cuts the 4,096-token samples to this


def prepare(out: Path, samples: int, shared_data: Path = SHARED_DATA) -> dict[str, Any]:
    """``samples`` 4,096-token MDS samples of the shared corpora (repeated as needed) and the tokenizer, under
    ``out``."""
    corpus = [str(path) for path in sorted((shared_data / "corpus").rglob("*.txt"))]
    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b"
    if not corpus or not tokenizer.is_dir():
        raise SystemExit(f"no corpus or gpt-neox-20b tokenizer under {shared_data}: pass --shared-data")
    build_data(corpus, str(tokenizer), samples, out / "mds", seq_len=SEQ_LEN)
    shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)
    index = json.loads((out / "mds" / "train" / "index.json").read_text())
    return {"train_samples": sum(shard["samples"] for shard in index["shards"]), "seq_len": SEQ_LEN}


def row_overrides(args: argparse.Namespace) -> list[str]:
    """What every row changes in its YAML: random weights, the prepared data, the length of the run."""
    data, seq_len = Path(args.data).resolve(), SMOKE_SEQ_LEN if args.smoke else SEQ_LEN
    loader = (
        f"train_loader={{name: text, drop_last: true, num_workers: {0 if args.smoke else 2}, dataset: "
        f"{{local: {data / 'mds'}, split: train, shuffle: false, max_seq_len: {seq_len}}}}}"
    )
    overrides = [
        *RANDOM_WEIGHTS, loader, f"tokenizer.name={data / 'tokenizer'}", f"max_duration={args.batches}ba",
        f"callbacks.speed_monitor.warmup_batches={args.warmup}", "console_log_interval=1ba",
    ]  # fmt: skip
    return overrides + (SMOKE if args.smoke else []) + args.set


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row as a user runs it; tokens/s per GPU, MFU and peak memory from its metrics.jsonl, or why it stopped."""
    yaml, gpus = ROWS[name]
    nproc = SMOKE_NPROC if args.smoke else gpus
    run_folder = Path(args.work) / name
    shutil.rmtree(run_folder, ignore_errors=True)
    started_s = time.perf_counter()
    returncode = foundry_train(yaml, run_folder, row_overrides(args), nproc, args.row_timeout)
    log = (run_folder.parent / f"{name}.log").read_text(errors="replace").splitlines()
    metrics = run_metrics(run_folder) if (run_folder / "metrics.jsonl").is_file() else {}
    return {
        "row": name, "yaml": str(yaml.relative_to(REPO_ROOT)), "gpus": nproc,
        "tokens_per_s_per_gpu": metrics.get("tokens_per_s_per_gpu"), "mfu": metrics.get("mfu"),
        "peak_allocated_gib": metrics.get("peak_gib"), "peak_reserved_gib": metrics.get("peak_reserved_gib"),
        "steady_batches": metrics.get("steady_batches"), "first_batch_s": metrics.get("first_batch_s"),
        "exit": "timeout" if returncode is None else returncode, "wall_s": round(time.perf_counter() - started_s, 1),
        "log_tail": log[-15:],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.rows:  # each row its own process group: one that runs out of memory loses no other
        result = {**run_row(name, args), "environment": environment()}
        (out / f"largest_models_{name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
        print(f"{name}: exit {result['exit']}, {result['wall_s']} s", flush=True)
        if result["exit"] != 0:
            print("\n".join(result["log_tail"]), flush=True)
    shown = ("row", "gpus", "tokens_per_s_per_gpu", "mfu", "peak_allocated_gib", "steady_batches", "exit")
    print(markdown_table([{key: result[key] for key in shown} for result in results]))
    return 0 if all(result["exit"] == 0 for result in results) else 1


def main() -> int:
    parser, _, run_parser = prepare_and_run_parsers(
        __doc__, prepared="the MDS data and tokenizer", samples=200, sample_tokens="4,096-token",
        run_help="train the rows (on the GPU machine)",
    )  # fmt: skip
    run_parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    run_parser.add_argument("--data", default="data/largest_models", help="the folder `prepare` wrote")
    run_parser.add_argument("--batches", type=int, default=6)
    run_parser.add_argument("--warmup", type=int, default=2, help="first batches left out of the averages")
    run_parser.add_argument("--row-timeout", type=float, default=540.0, help="seconds before a row is stopped")
    run_parser.add_argument("--work", default="/tmp/foundry-largest-models", help="the rows' run folders and logs")
    run_parser.add_argument("--smoke", action="store_true", help="a tiny Llama per YAML on two gloo ranks (CPU)")
    run_parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="one more override for every row (repeatable)"
    )
    run_parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.action == "prepare":
        print(prepare(Path(args.out), args.samples, Path(args.shared_data)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
