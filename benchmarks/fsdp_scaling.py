"""FSDP2 FULL_SHARD scaling: tokens/s per GPU, MFU and peak memory of a YAML's model on 1 and N GPUs.

Random tokens, fixed per-GPU microbatch (one microbatch per step), amp_bf16 with ``mixed_precision: PURE``,
through the Trainer. The script re-launches itself with torchrun for each GPU count::

    python benchmarks/fsdp_scaling.py yamls/pretrain/mpt-1b.yaml --nproc 1 2 --microbatch 8 --out results/
    # CPU smoke test: --device cpu --override model.d_model=64 model.n_layers=2 model.n_heads=4 \
    #     model.vocab_size=256 model.max_seq_len=64 model.attn_config.attn_impl=sdpa
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_utils import environment, model_from_yaml, random_batch, write_results

from foundry import Callback
from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.distributed import get_rank, get_world_size
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer


class BatchTimes(Callback):
    """Wall time at each BATCH_END (after the device finished the batch)."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def batch_end(self, state, logger) -> None:
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        self.times_s.append(time.perf_counter())


def worker(args: argparse.Namespace) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    model, seq_len = model_from_yaml(args.config, args.override)
    seq_len = min(seq_len or model.config.max_seq_len, model.config.max_seq_len)
    batches = [random_batch(args.microbatch, seq_len, model.config.vocab_size, torch.device("cpu")) for _ in range(4)]
    times = BatchTimes()
    trainer = Trainer(
        model=model,
        train_dataloader=batches * (args.batches // 4 + 1),
        max_duration=f"{args.batches}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-4),
        fsdp_config={"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE"},
        precision="amp_bf16",
        device=device,
        callbacks=[times],
        log_to_console=False,
        run_folder=tempfile.mkdtemp(),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit()
    measured = times.times_s[args.warmup :]
    seconds_per_batch = (measured[-1] - measured[0]) / (len(measured) - 1)
    flops_per_gpu = trainer.state.model.flops_per_batch(batches[0])
    peak = peak_flops_per_sec(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    row = {
        "gpus": get_world_size(),
        "microbatch_per_gpu": args.microbatch,
        "seq_len": seq_len,
        "params_M": round(sum(p.numel() for p in trainer.state.model.parameters()) / 1e6, 1),  # DTensor: global
        "s_per_batch": round(seconds_per_batch, 4),
        "tokens_per_s_per_gpu": round(args.microbatch * seq_len / seconds_per_batch, 1),
        "mfu": round(flops_per_gpu / seconds_per_batch / peak, 4) if peak else None,
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }
    if get_rank() == 0:
        Path(args.row_file).write_text(json.dumps(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="yamls/pretrain/mpt-1b.yaml")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatch", type=int, default=8, help="samples per GPU per step")
    parser.add_argument("--batches", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="batches not timed")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--override", nargs="*", default=[])
    parser.add_argument("--out", default=None)
    parser.add_argument("--row-file", help=argparse.SUPPRESS)  # set when this is a torchrun rank
    args = parser.parse_args()
    if args.row_file:
        worker(args)
        return 0
    rows = []
    for nproc in args.nproc:
        row_file = Path(tempfile.mkdtemp()) / "row.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += [__file__, args.config, "--microbatch", str(args.microbatch), "--batches", str(args.batches)]
        command += ["--warmup", str(args.warmup), "--device", args.device, "--row-file", str(row_file)]
        command += ["--override", *args.override] if args.override else []
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": _pythonpath()})
        rows.append(json.loads(row_file.read_text()))
    one_gpu = rows[0]["tokens_per_s_per_gpu"]
    for row in rows:
        row["per_gpu_vs_1"] = round(row["tokens_per_s_per_gpu"] / one_gpu, 3)
    write_results(args.out, "fsdp_scaling", rows)
    print(json.dumps(environment()))
    return 0


def _pythonpath() -> str:
    here = Path(__file__).resolve().parent
    return os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])


if __name__ == "__main__":
    sys.exit(main())
