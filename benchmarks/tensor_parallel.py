"""Tensor parallelism on two GPUs: the Llama-3-8B shape with FSDP2 alone against TP2, side by side.

    python benchmarks/tensor_parallel.py --out OUT_DIR        # two GPUs, about 8 minutes; rows in priority order
    python benchmarks/tensor_parallel.py --smoke              # tiny rows on two CPU ranks: checks the script

The script launches itself on 2 ranks through torchrun (what ``foundry train --nproc 2`` runs) and trains each
row through the Trainer ``foundry train`` builds from ``yamls/pretrain/llama-8b.yaml`` (its optimizer, gradient
clipping, FSDP2, compile, bf16) with every block checkpointed (the YAML's ``auto`` is resolved by ``foundry train``
only, and not under tensor parallelism), with ``variables.max_seq_len`` and ``parallelism.tensor_parallel_degree``
overridden, the weights drawn on each GPU (``model.init_device=cuda``, the same seed on both ranks: no minute of 8B
CPU init on rank 0) and random tokens in memory (the GPU image lacks mosaicml-streaming). Every row trains the same
global batch, 2 sequences a step: FSDP2 gives each GPU one sequence; TP2 (data-parallel degree 1) gives both GPUs
both, one microbatch at a time, each GPU computing half of every block's linears.

Rows (``--rows`` picks; each is skipped when the time left in ``--budget-s`` is below its estimate):
``fsdp-8k``, ``tp2-8k``, ``fsdp-16k``, ``tp2-16k`` (TP2 with sequence parallelism, the default), then
``tp2-8k-no-sp`` (``parallelism.sequence_parallel=false``); opt-in: ``tp2-8k-meta`` (the YAML's meta-device
init), ``tp2-8k-lora`` (LoRA r 16 on every block linear), ``fsdp-8k-float8`` and ``tp2-8k-float8`` (tensorwise
float8 on the middle blocks' linears). Per row: tokens/s per GPU, MFU (LLM Foundry's
formula, docs/MODELS.md, over the GPU's dense bf16 peak), peak allocated memory and seconds a step over the steps
after ``WARMUP_STEPS``. The table is printed and written after every row: a call cut off keeps the rows that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_utils import (
    EVERY_BLOCK_CHECKPOINTED,
    REPO_ROOT,
    markdown_table,
    print_report,
    run_on_ranks,
    save_json,
    yaml_trainer,
)
from long_context import LORA_ALL_LINEAR, BatchTimes, free_memory

from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.config import load_train_config
from foundry.distributed import broadcast_object, get_rank, get_world_size, init_process_group

LLAMA_8B = "yamls/pretrain/llama-8b.yaml"
SEQUENCES_PER_STEP = 2  # the global batch of every row
STEPS, WARMUP_STEPS = 12, 4
FLOAT8 = "algorithms.float8={recipe: tensorwise}"
# name -> (tokens a sequence, tensor-parallel degree, overrides, estimated seconds on 2 H200s with setup)
ROWS: dict[str, tuple[int, int, list[str], int]] = {
    "fsdp-8k": (8192, 1, [], 75),
    "tp2-8k": (8192, 2, [], 90),
    "fsdp-16k": (16384, 1, [], 100),
    "tp2-16k": (16384, 2, [], 120),
    "tp2-8k-no-sp": (8192, 2, ["parallelism.sequence_parallel=false"], 90),
    # opt-in (--rows names them): the YAML's own meta-device init (rank 0 draws the 8B weights on the CPU and
    # sends them), and LoRA on every block linear
    "tp2-8k-meta": (8192, 2, ["model.init_device=meta"], 200),
    "tp2-8k-lora": (8192, 2, [LORA_ALL_LINEAR], 90),
    # opt-in: tensorwise float8 (its shards all-gathered in float8) under FSDP2 alone and under TP2
    "fsdp-8k-float8": (8192, 1, [FLOAT8], 90),
    "tp2-8k-float8": (8192, 2, [FLOAT8], 100),
}
OPT_IN_ROWS = ("tp2-8k-meta", "tp2-8k-lora", "fsdp-8k-float8", "tp2-8k-float8")
# three blocks: float8 keeps the first and last in bf16, and converts the middle one
SMOKE_MODEL = ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.kv_n_heads=2", "model.vocab_size=512"]


def rank_batches(seq_len: int, vocab_size: int, tensor_parallel_degree: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of each step's ``SEQUENCES_PER_STEP`` random sequences (tensor-parallel ranks share)."""
    data_rank, data_ranks = get_rank() // tensor_parallel_degree, get_world_size() // tensor_parallel_degree
    per_rank = SEQUENCES_PER_STEP // data_ranks
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, vocab_size, (SEQUENCES_PER_STEP, seq_len), generator=generator) for _ in range(STEPS)]
    return [{"input_ids": ids[data_rank * per_rank : (data_rank + 1) * per_rank]} for ids in steps]


def run_row(name: str, smoke: bool) -> dict[str, Any]:
    seq_len, tp, row_overrides, _ = ROWS[name]
    overrides = [f"parallelism.tensor_parallel_degree={tp}", EVERY_BLOCK_CHECKPOINTED, *row_overrides]
    trainer_overrides: dict[str, Any] = {}
    if smoke:  # the same rows, tiny, on CPU ranks: checks the script, not the speed
        seq_len //= 512
        overrides += SMOKE_MODEL
        trainer_overrides = {"device": "cpu", "precision": "fp32", "compile_config": False}
    overrides.append(f"variables.max_seq_len={seq_len}")
    if not any(override.startswith("model.init_device=") for override in overrides):
        overrides.append(f"model.init_device={'cpu' if smoke else 'cuda'}")
    cfg, _ = load_train_config(REPO_ROOT / LLAMA_8B, overrides)
    batches = rank_batches(seq_len, cfg.model["vocab_size"], tp)
    times = BatchTimes()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(cfg.seed)  # the model is built before the Trainer seeds: the same weights on every rank
    trainer = yaml_trainer(cfg, batches, microbatch=1, callbacks=[times], **trainer_overrides)
    trainer.fit()
    timed = times.times_s[WARMUP_STEPS:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1)
    # each GPU computes 1/tp of its data rank's batch
    flops_per_gpu = trainer.state.model.flops_per_batch(batches[0]) / tp
    peak = peak_flops_per_sec(torch.cuda.get_device_name(), "bf16") if torch.cuda.is_available() else None
    row = {
        "row": name,
        "seq_len": seq_len,
        "tensor_parallel_degree": tp,
        "sequence_parallel": cfg.parallelism.sequence_parallel if tp > 1 else None,
        "tokens_per_s_per_gpu": round(SEQUENCES_PER_STEP * seq_len / step_s / get_world_size(), 1),
        "mfu": round(flops_per_gpu / step_s / peak, 4) if peak else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "s_per_step": round(step_s, 3),
        "first_step_s": round(times.times_s[0] - times.fit_start_s, 1),
        "timed_steps": len(timed) - 1,
    }
    del trainer
    free_memory()
    return row


def worker(args: argparse.Namespace) -> None:
    init_process_group()
    started_s, rows = time.perf_counter(), []
    for name in args.rows:
        left_s = args.budget_s - (time.perf_counter() - started_s)
        if broadcast_object(left_s < ROWS[name][3]):  # rank 0's clock decides for all: every rank runs the same rows
            rows.append({"row": name, "skipped": f"{left_s:.0f} s left of --budget-s, row needs ~{ROWS[name][3]} s"})
        else:
            try:
                rows.append(run_row(name, args.smoke))
            except Exception as error:  # a row that fails (out of memory) leaves the others their time
                rows.append({"row": name, "error": f"{type(error).__name__}: {str(error)[:400]}"})
                free_memory()
        if get_rank() == 0:  # after each row: a call cut off keeps the rows that ran
            print(json.dumps(rows[-1]), flush=True)
            save_json(args.out, "tensor_parallel", rows)
            if args.out:
                Path(args.out, "tensor_parallel.md").write_text(markdown_table(rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_rows = [name for name in ROWS if name not in OPT_IN_ROWS]
    parser.add_argument("--rows", nargs="*", default=default_rows, choices=list(ROWS))
    parser.add_argument("--budget-s", type=float, default=500.0, help="rows that would not fit are skipped")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU ranks: checks the script runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set on the torchrun ranks
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    worker_args = ["--rows", *args.rows, "--budget-s", str(args.budget_s)]
    worker_args += (["--out", args.out] if args.out else []) + (["--smoke"] if args.smoke else [])
    returncode = run_on_ranks(__file__, 2, worker_args)
    print_report(args.out, "tensor_parallel")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
