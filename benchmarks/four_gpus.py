"""Four GPUs through ``foundry train`` on MDS data: Llama-8B at 8k, 128k and 256k tokens, the 30B mixture of experts.

    # here, once: MDS samples of real text (the shared corpora, repeated as needed; gpt-neox-20b): 8,192-token
    # samples (the 8k rows, and the MoE rows' 4,096 cut from them) and 262,144-token ones (the 128k rows cut them)
    python benchmarks/four_gpus.py prepare --out data/four_gpus
    # on a four-GPU host (mosaicml-streaming and torchao installed), rows in the order given, each on its own
    python benchmarks/four_gpus.py run --data data/four_gpus --out OUT --rows llama-8b-8k llama-8b-8k-float8 \\
        --budget-s 560

Each row is ``foundry train <shipped YAML> --nproc 4`` with only the data, the run's length, the global batch and the
row's own keys overridden (``ROWS``); tokens/s per GPU, MFU and peak memory are the speed monitor's and the memory
monitor's (``default_path.run_metrics``: the steady batches after ``warmup``). A row runs under what is left of
``--budget-s``, and no row starts with less than its estimate left; a row that fails (out of memory) or is cut
off keeps its error or its last batch's figures (``callbacks.speed_monitor.window_size=1``), and the next row
runs. The table is printed and ``OUT/four_gpus.json`` rewritten after every row.

- ``llama-8b-8k``: ``llama-8b.yaml`` at 8,192 tokens, 16 sequences a step (4 a GPU, microbatch 1), FSDP2 over
  four, every block checkpointed (``fsdp_config.activation_checkpointing=true``: the YAML ships ``auto``, which on
  141 GB cards checkpoints none; ``benchmarks/peers.py --four-gpu`` runs that); ``-float8`` adds
  ``algorithms.float8`` (tensorwise, float8 all-gathers), ``-float8-rowwise`` rowwise.
- ``llama-8b-128k``: ``llama-8b-128k.yaml`` as shipped (CP4), 4 sequences a step (the least four ranks load);
  ``llama-8b-256k``: ``llama-8b-256k.yaml`` (CP4, 141 GB cards): a step is 1M tokens (2.4 minutes at 1,851
  tokens/s per GPU; the row took 338 s on four H200s), so it wants most of a call to itself.
- ``qwen3-30b-a3b``: ``qwen3-30b-a3b.yaml`` as shipped (FSDP2 alone, microbatch 16), 128 sequences of 4,096 a
  step; ``-ep4``: experts over the four GPUs; ``-mb8`` and ``-ep4-mb8``: microbatch 8.

Weights are initialised on the GPUs for the 8B rows (``model.init_device=cuda``, as ``default_path.py --two-gpu``
does: a minute less setup); the 30B YAML draws its own a module at a time on rank 0's GPU
(``fsdp_config.init_on_device``: its whole fp32 copy would not fit one). ``run --smoke`` checks the plumbing on the
CPU: tiny widths, a few steps, one rank a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import (
    EVERY_BLOCK_CHECKPOINTED,
    REPO_ROOT,
    SHARED_DATA,
    environment,
    foundry_train,
    latest_metrics,
    markdown_table,
    train_losses,
)
from default_path import build_data, run_metrics
from float8_judge import FELL_BACK
from peers_rows import FOUR_GPU_8K, SMOKE_FOUNDRY, SMOKE_SETTINGS

GPUS = 4
LLAMA_8B, CONTEXT_128K, CONTEXT_256K, QWEN3 = (
    f"yamls/pretrain/{name}.yaml" for name in ("llama-8b", "llama-8b-128k", "llama-8b-256k", "qwen3-30b-a3b")
)
FLOAT8 = "algorithms.float8={}"
GPU_INIT = "model.init_device=cuda"
EIGHT_K = (*FOUR_GPU_8K, EVERY_BLOCK_CHECKPOINTED)  # as the 8k rows were measured
# name -> the MDS folder under --data and the samples `prepare` writes there
DATASETS = {"8k": ("mds-8k", 8192, 800), "256k": ("mds-256k", 262144, 14)}  # the MoE rows read 768
EVAL_FRACTION = 0.1  # the val split (unread: rows run without eval) must still hold one 262,144-token sample


@dataclasses.dataclass(frozen=True)
class Row:
    yaml: str
    dataset: str  # DATASETS key; the loader cuts samples to the row's max_seq_len
    global_batch: int
    batches: int
    warmup: int  # batches left out of the averages (compile and the first gathers)
    estimate_s: float  # setup, compile and every batch at the target speed: a row needing more is skipped
    overrides: tuple[str, ...] = ()


MOE_BATCH = 128
ROWS = {
    "llama-8b-8k": Row(LLAMA_8B, "8k", 16, 8, 3, 240, EIGHT_K),
    "llama-8b-8k-float8": Row(LLAMA_8B, "8k", 16, 8, 3, 300, (*EIGHT_K, FLOAT8)),
    "llama-8b-8k-float8-rowwise": Row(LLAMA_8B, "8k", 16, 8, 3, 300, (*EIGHT_K, "algorithms.float8={recipe: rowwise}")),
    "llama-8b-128k": Row(CONTEXT_128K, "256k", 4, 3, 1, 330, (GPU_INIT,)),
    "llama-8b-256k": Row(CONTEXT_256K, "256k", 4, 2, 1, 560, (GPU_INIT,)),
    "qwen3-30b-a3b": Row(QWEN3, "8k", MOE_BATCH, 6, 2, 420),
    "qwen3-30b-a3b-mb8": Row(QWEN3, "8k", MOE_BATCH, 6, 2, 420, ("device_train_microbatch_size=8",)),
    "qwen3-30b-a3b-ep4": Row(QWEN3, "8k", MOE_BATCH, 6, 2, 420, ("parallelism.expert_parallel_degree=4",)),
    "qwen3-30b-a3b-ep4-mb8": Row(QWEN3, "8k", MOE_BATCH, 6, 2, 420, (
        "parallelism.expert_parallel_degree=4", "device_train_microbatch_size=8",
    )),
}  # fmt: skip
SMOKE_FAMILY = {LLAMA_8B: "llama", CONTEXT_128K: "llama", CONTEXT_256K: "llama", QWEN3: "llama"}
SMOKE_MOE = ["model.moe_num_experts=8", "model.moe_top_k=2", "model.ffn_hidden_size=32", "model.head_dim=16"]


def prepare(out: Path, shared_data: Path = SHARED_DATA) -> None:
    """The MDS folders of ``DATASETS`` and the tokenizer under ``out`` (the shared corpora, repeated as needed)."""
    corpus = [str(path) for path in sorted((shared_data / "corpus").rglob("*.txt"))]
    if not corpus:
        raise SystemExit(f"no text under {shared_data}/corpus: pass --shared-data")
    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b"
    for folder, seq_len, samples in DATASETS.values():
        build_data(corpus, str(tokenizer), samples, out / folder, seq_len, EVAL_FRACTION)
    shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)


def row_overrides(name: str, data: Path, smoke: bool) -> list[str]:
    """What a row changes in its YAML: the data, the run's length and batch, the speed monitor, the row's keys."""
    row = ROWS[name]
    overrides = [
        f"variables.data_local={data / DATASETS[row.dataset][0]}", f"tokenizer.name={data / 'tokenizer'}",
        "eval_loader=null", f"max_duration={row.batches}ba", f"global_train_batch_size={row.global_batch}",
        f"callbacks.speed_monitor.warmup_batches={row.warmup}", "callbacks.speed_monitor.window_size=1",
        "train_loader.num_workers=2", *row.overrides,
    ]  # fmt: skip
    if smoke:  # one CPU rank: tiny widths, short sequences, no context or expert parallelism
        overrides = [o for o in overrides if o != GPU_INIT and not o.startswith("device_train_microbatch_size")]
        overrides += [*SMOKE_FOUNDRY[SMOKE_FAMILY[row.yaml]], *SMOKE_SETTINGS, "compile_config=false",
                      "parallelism.context_parallel_degree=1", "parallelism.expert_parallel_degree=1",
                      "global_train_batch_size=2", "device_train_microbatch_size=1"]  # fmt: skip
        overrides += SMOKE_MOE if row.yaml == QWEN3 else []
    return overrides


def run_row(name: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """One row through ``foundry train``; its figures, or its error and what it logged before it."""
    run_folder = Path(args.work) / name
    shutil.rmtree(run_folder, ignore_errors=True)
    (run_folder.parent / f"{name}.log").unlink(missing_ok=True)
    overrides = row_overrides(name, Path(args.data).resolve(), args.smoke)
    nproc = 1 if args.smoke else GPUS
    started_s = time.perf_counter()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if args.smoke else None
    returncode = foundry_train(REPO_ROOT / ROWS[name].yaml, run_folder, overrides, nproc, timeout_s, env)
    log = (run_folder.parent / f"{name}.log").read_text(errors="replace").strip().splitlines()
    result: dict[str, Any] = {"row": name, "gpus": nproc, "returncode": returncode,
                              "wall_s": round(time.perf_counter() - started_s, 1)}  # fmt: skip
    if (run_folder / "metrics.jsonl").is_file():
        result.update(run_metrics(run_folder) if returncode == 0 else last_batch(run_folder))
    if returncode != 0:
        result["error"] = "cut off at the time left" if returncode is None else (log or ["no output"])[-1][:300]
    elif not args.smoke and any(FELL_BACK in line for line in log):  # its figures are bf16's, not float8's
        result["error"] = "float8 fell back to bf16"
    result["command"] = f"foundry train {ROWS[name].yaml} {' '.join(overrides)} --nproc {nproc}"
    return result


def last_batch(run_folder: Path) -> dict[str, Any]:
    """The last batch's tokens/s per GPU, MFU and the peak memory so far, from a run that did not finish."""
    latest = latest_metrics(run_folder)
    return {"partial": True, "tokens_per_s_per_gpu": latest.get("throughput/device/tokens_per_sec"),
            "mfu": latest.get("throughput/device/mfu"), "peak_gib": latest.get("memory/peak_allocated_mem"),
            "batches_logged": len(train_losses(run_folder))}  # fmt: skip


SHOWN = ("row", "tokens_per_s_per_gpu", "mfu", "peak_gib", "steady_batches", "first_batch_s", "wall_s", "error")


def run(args: argparse.Namespace) -> int:
    if args.smoke and not args.data:
        args.data = str(Path(args.work) / "smoke-data")
        smoke_data(Path(args.data))
    deadline = time.monotonic() + args.budget_s
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.rows:
        left_s = deadline - time.monotonic()
        if not args.smoke and left_s < ROWS[name].estimate_s:
            rows.append({"row": name, "error": f"skipped: {left_s:.0f} s left, {ROWS[name].estimate_s:.0f} s needed"})
        else:
            rows.append({"environment": environment(), **run_row(name, args, left_s)})
        (out / "four_gpus.json").write_text(json.dumps(rows, indent=2))
        print(markdown_table([{key: row.get(key) for key in SHOWN} for row in rows]), flush=True)
    return 0 if all(row.get("returncode") == 0 and "error" not in row for row in rows) else 1


def smoke_data(out: Path) -> None:
    """A few short samples in every ``DATASETS`` folder (the tiny rows cut them to 256 tokens)."""
    corpus = [str(sorted((SHARED_DATA / "corpus").rglob("*.txt"))[0])]
    tokenizer = SHARED_DATA / "tokenizers" / "gpt-neox-20b"
    for folder, _, _ in DATASETS.values():
        build_data(corpus, str(tokenizer), 24, out / folder, seq_len=512)
    shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    prepare_parser = commands.add_parser("prepare", help="the MDS data (here, before the GPU call)")
    prepare_parser.add_argument("--out", required=True)
    prepare_parser.add_argument("--shared-data", default=str(SHARED_DATA))
    run_parser = commands.add_parser("run", help="train the rows (on the four-GPU host)")
    run_parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    run_parser.add_argument("--data", default=None, help="the folder `prepare` wrote")
    run_parser.add_argument("--budget-s", type=float, default=560.0, help="rows stop when this much time has passed")
    run_parser.add_argument("--work", default="/tmp/foundry-four-gpus")
    run_parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the plumbing")
    run_parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(Path(args.out), Path(args.shared_data))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
