"""MFU of the shipped YAMLs through the path a user takes: `foundry train` on MDS data read by StreamingDataset.

    python benchmarks/default_path.py --corpus a.txt b.txt --tokenizer DIR --out OUT \\
        --rows mpt-125m mpt-1b llama-1b llm-foundry-mpt-1b hf-llama hf-llama-compiled

1. ``foundry data convert`` tokenizes the corpus into 2048-token MDS samples, repeating the text until
   there are ``--samples`` of them (so no row crosses an epoch boundary while it is timed).
2. Each foundry row runs ``foundry train <yaml>`` in a fresh process with only paths and the run's length
   changed: ``variables.data_local``, ``tokenizer.name``, ``max_duration``, ``run_folder`` and no eval loader
   (eval time is not train time, and costs device time here). Everything that sets speed (compile,
   loss, attention, sharding, microbatch, the global batch, logging every batch) is the YAML's own.
   The row's MFU and tokens/s are the speed monitor's averages over the steady part of the run
   (``throughput/run/*`` in metrics.jsonl: every batch after its ``warmup_batches``), the same
   numbers the run summary prints.
3. The baseline is ``benchmarks/mfu.py``'s plain PyTorch loop over Hugging Face's ``LlamaForCausalLM``
   (~1.4B parameters), eager and ``torch.compile``d, in the same call.

``--set 'ROW:key=value;key=value'`` adds a row: ROW's YAML with more overrides (e.g. a microbatch sweep).

``--two-gpu`` runs ``TWO_GPU_ROWS`` instead: ``yamls/pretrain/llama-8b.yaml`` on two GPUs at a global batch of 16
(two microbatches of 4 a GPU), as shipped (``activation_checkpointing: auto``: the blocks the card's memory
asks for), with every block checkpointed, and with the memory levers that buy back recomputation by hand (bf16 Adam
moments, fewer checkpointed blocks, a smaller microbatch; docs/DISTRIBUTED.md has the arithmetic), each for 10
batches with 3 left out of the averages. The weights are initialised on the GPUs (``model.init_device=cuda``,
the same seed on both ranks) rather than on rank 0's CPU: the same training, a minute less setup a row. On the
GPU machine (with ``.whl``, the mosaicml-streaming wheels, and an MDS folder of 2048-token samples)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/default_path.py --two-gpu --data data/float8_loss/mds \
        --tokenizer data/float8_loss/tokenizer --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_utils import EVERY_BLOCK_CHECKPOINTED, REPO_ROOT, TRAIN_LOSS, latest_metrics, markdown_table, save_json

# name -> (YAML, batches to train, batches left out of the averages). A 1B batch is 512 x 2048 tokens (~16 s on
# an H100, 32-128 microbatches), so one warm-up batch (compile included) and one timed one: all rows and the
# baseline then fit one 10-minute device call. MPT-125M's batch is 256 x 2048 (~1 s): 2 warm-up, 6 timed.
ROWS: dict[str, tuple[str, int, int]] = {
    "mpt-125m": ("yamls/pretrain/mpt-125m.yaml", 8, 2),
    "mpt-1b": ("yamls/pretrain/mpt-1b.yaml", 2, 1),
    "llama-1b": ("yamls/pretrain/llama-1b.yaml", 2, 1),
    # 7B-class: sharded over several GPUs (--set 'mpt-7b:global_train_batch_size=32;--nproc;2'); a batch of the
    # shipped 1024 would take minutes, so rows set a smaller global batch. 2 warm-up batches (compile), 2 timed.
    "mpt-7b": ("yamls/pretrain/mpt-7b.yaml", 4, 2),
    "llama-8b": ("yamls/pretrain/llama-8b.yaml", 4, 2),
    "llm-foundry-mpt-1b": ("llm-foundry-yamls/pretrain/mpt-1b.yaml", 2, 1),  # under --reference-yamls
    "llm-foundry-mpt-125m": ("llm-foundry-yamls/pretrain/mpt-125m.yaml", 8, 2),
}
BASELINES = ("hf-llama", "hf-llama-compiled")
# --two-gpu: llama-8b.yaml's overrides a row, in the order they run (the most likely to pay first). Every block
# recomputed costs a forward (~25% of a step); each block left out of the checkpoint gives that back for its
# share and holds its activations instead (about 1 GiB at 4 x 2048 tokens), which bf16 moments (15 GiB a GPU
# less) and a smaller microbatch make room for.
TWO_GPU_COMMON = ["global_train_batch_size=16", "model.init_device=cuda"]
TWO_GPU_BATCHES = (10, 3)
BF16_MOMENTS = "optimizer.moments_dtype=bfloat16"


def first_blocks_checkpointed(blocks: int) -> list[str]:
    """The first ``blocks`` blocks checkpointed, chosen by hand: a target takes ``true`` (``auto`` refuses one)."""
    return [
        "fsdp_config.activation_checkpointing=true",
        f"model.activation_checkpointing_target={{mptblock: {blocks}}}",
    ]


TWO_GPU_ROWS: dict[str, list[str]] = {
    "llama-8b as shipped": [],  # activation_checkpointing: auto, by the card's memory
    "every block checkpointed": [EVERY_BLOCK_CHECKPOINTED],  # the baseline the levers below buy back from
    "float8 (torchao), otherwise as shipped": ["algorithms.float8={}"],
    "bf16 moments, 20 of 32 blocks checkpointed": [BF16_MOMENTS, *first_blocks_checkpointed(20)],
    "microbatch 2, bf16 moments, 8 of 32 checkpointed": [
        BF16_MOMENTS, "device_train_microbatch_size=2", *first_blocks_checkpointed(8),
    ],
    "bf16 moments, 16 of 32 checkpointed": [BF16_MOMENTS, *first_blocks_checkpointed(16)],
    "microbatch 2, bf16 moments, none checkpointed": [
        BF16_MOMENTS, "device_train_microbatch_size=2", "fsdp_config.activation_checkpointing=false",
    ],
}  # fmt: skip
SEQ_LEN = 2048


def two_gpu_jobs() -> list[tuple[str, list[str], str, tuple[int, int]]]:
    """``--two-gpu``'s rows as (ROWS name, overrides, label, (batches, batches left out of the averages))."""
    rows = TWO_GPU_ROWS.items()
    return [("llama-8b", [*TWO_GPU_COMMON, *extra, "--nproc", "2"], label, TWO_GPU_BATCHES) for label, extra in rows]


def build_data(
    corpus: list[str], tokenizer: str, samples: int, out: Path, seq_len: int = SEQ_LEN, eval_fraction: float = 0.01
) -> Path:
    """MDS shards of ``samples`` ``seq_len``-token samples (the corpus repeated as often as needed) under ``out``.

    ``eval_fraction`` of the text goes to the val split, which must hold one whole sample.
    """
    if (out / "train" / "index.json").exists():
        return out
    text = "\n\n".join(Path(path).read_text() for path in corpus)
    # About 4 characters a token for English BPE; one spare copy so the train split surely holds enough.
    copies = max(1, int(samples * seq_len * 4 / (1 - eval_fraction)) // len(text) + 1)
    source = out.parent / "corpus-copies"
    source.mkdir(parents=True, exist_ok=True)
    for copy in range(copies):
        (source / f"copy{copy:03d}.txt").write_text(text)
    command = ["data", "convert", str(source), "--out", str(out), "--tokenizer", tokenizer]
    command += ["--concat-tokens", str(seq_len), "--eval-fraction", str(eval_fraction), "--no-progress"]
    subprocess.run([sys.executable, "-m", "foundry.cli", *command], check=True, cwd=REPO_ROOT)
    shutil.rmtree(source)
    return out


def run_foundry_row(
    name: str, yaml_path: Path, batches: Sequence[int], extra: list[str], args: argparse.Namespace
) -> dict:
    """``foundry train`` as a user runs it; returns the run averages and peak memory from metrics.jsonl."""
    run_folder = Path(args.work) / "runs" / re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")
    total_batches, warmup_batches = batches
    overrides = [
        f"variables.data_local={args.data}",
        f"tokenizer.name={args.tokenizer}",
        f"max_duration={total_batches}ba",
        f"callbacks.speed_monitor.warmup_batches={warmup_batches}",
        "eval_loader=null",
        f"run_folder={run_folder}",
        *extra,
    ]
    started_s = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "foundry.cli", "train", str(yaml_path), *overrides],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall_s = time.perf_counter() - started_s
    log = process.stdout + process.stderr
    if args.out:
        (Path(args.out) / f"{run_folder.name}.log").write_text(log)
    result: dict[str, Any] = {"row": name, "yaml": str(yaml_path), "overrides": " ".join(extra), "wall_s": wall_s}
    if process.returncode != 0:
        return {**result, "error": f"exit {process.returncode}: {log.strip().splitlines()[-1][:300]}"}
    result.update(run_metrics(run_folder))
    result["summary"] = log[log.find("Run summary") :].strip() if "Run summary" in log else None
    profiles = [json.loads(path.read_text()) for path in sorted((run_folder / "profile").glob("rank*.summary.json"))]
    if profiles:  # callbacks.profiler among the overrides: where each rank's profiled batch went
        result["profile"] = [profile | {"top_kernels": profile["top_kernels"][:12]} for profile in profiles]
    return result


def run_metrics(run_folder: Path) -> dict[str, Any]:
    """A run's steady-state averages, setup times, peak memory and last train loss, from its metrics.jsonl."""
    latest = latest_metrics(run_folder)
    return {
        "mfu": latest.get("throughput/run/device/mfu"),
        "tokens_per_s": latest.get("throughput/run/tokens_per_sec"),
        "tokens_per_s_per_gpu": latest.get("throughput/run/device/tokens_per_sec"),
        "steady_batches": latest.get("throughput/run/batches"),
        "first_batch_s": latest.get("time/first_batch_s"),
        "compile_s": latest.get("time/compile_s"),
        "peak_gib": latest.get("memory/peak_allocated_mem"),
        "peak_reserved_gib": latest.get("memory/peak_reserved_mem"),
        "alloc_retries": latest.get("memory/alloc_retries"),
        "microbatch": latest.get("trainer/device_train_microbatch_size"),
        "loss": latest.get(TRAIN_LOSS),
    }


def run_baseline(name: str, args: argparse.Namespace) -> dict:
    """One of mfu.py's HF Llama rows (the plain loop, eager or compiled) in a fresh process."""
    out = Path(args.work) / name
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "mfu.py"), "--rows", name]
    command += ["--warmup", "2", "--steps", "3", "--out", str(out)]
    process = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if process.returncode != 0:
        return {"row": name, "error": (process.stdout + process.stderr).strip()[-300:]}
    (row,) = json.loads((out / "mfu.json").read_text())["rows"]
    return {"row": name, "mfu": row.get("mfu"), "tokens_per_s": row.get("tokens_per_s"),
            "peak_gib": row.get("peak_mem_gib"), "error": row.get("error")}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=[*ROWS, *BASELINES], choices=[*ROWS, *BASELINES])
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="ROW:key=value", help="extra rows: ROW plus an override"
    )
    parser.add_argument("--two-gpu", action="store_true", help="llama-8b.yaml and its memory levers on two GPUs")
    parser.add_argument("--corpus", nargs="+", help="text files for the MDS data (unless --data is given)")
    parser.add_argument("--data", default=None, help="MDS data already converted (train split of 2048-token samples)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (gpt-neox-20b)")
    parser.add_argument("--reference-yamls", default=str(REPO_ROOT.parent / "shared" / "data" / "reference"))
    parser.add_argument("--samples", type=int, default=3000, help="2048-token samples in the train split")
    parser.add_argument("--work", default="/tmp/foundry-default-path")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.data is None:
        args.data = build_data(args.corpus, args.tokenizer, args.samples, Path(args.work) / "data")
    os.makedirs(args.out, exist_ok=True) if args.out else None
    jobs = [(name, [], name, ROWS.get(name, (None,))[1:]) for name in ([] if args.two_gpu else args.rows)]
    for spec in args.set:
        row, _, overrides = spec.partition(":")
        jobs.append((row, overrides.split(";"), f"{row}[{overrides}]", ROWS[row][1:]))
    jobs += two_gpu_jobs() if args.two_gpu else []
    results = []
    for row, extra, label, batches in jobs:  # in the order given; results are saved after each
        if row in BASELINES:
            results.append(run_baseline(row, args))
        else:
            base = Path(args.reference_yamls) if row.startswith("llm-foundry") else REPO_ROOT
            results.append(run_foundry_row(label, base / ROWS[row][0], batches, extra, args))
        print({key: value for key, value in results[-1].items() if key != "summary"}, flush=True)
        save_json(args.out, "default_path", results)
    compiled_baseline = next((r.get("mfu") for r in results if r["row"] == "hf-llama-compiled"), None)
    for row in results:
        if compiled_baseline and row.get("mfu"):
            row["vs_hf_compiled"] = row["mfu"] / compiled_baseline
    save_json(args.out, "default_path", results)
    shown = (
        "row",
        "mfu",
        "vs_hf_compiled",
        "tokens_per_s",
        "peak_gib",
        "peak_reserved_gib",
        "first_batch_s",
        "compile_s",
        "wall_s",
        "error",
    )
    print(markdown_table([{key: row.get(key) for key in shown} for row in results]))
    for row in results:
        if row.get("summary"):
            print(f"\n{row['row']}:\n{row['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
