"""How far rounding alone moves a bf16 run, beside context parallelism's difference: 2 CPU ranks, minutes.

    python benchmarks/cp_rounding.py --out OUT                      # amp_bf16, bf16 Adam moments, 60 steps
    python benchmarks/cp_rounding.py --precision fp32 --out OUT     # the same in fp32: agreement to ~1e-6

A tiny Llama (RoPE, grouped-query attention) on 2 gloo ranks, FSDP2 over both, trained as
``yamls/pretrain/llama-8b-64k.yaml`` trains (``mixed_precision: PURE``, bf16 moments, gradient clipping, warmup
then cosine) with a high learning rate on 3 fixed global batches, so the loss falls fast and small
differences grow. Three runs on the same batches from the same weights:

- ``fsdp``: one sample a microbatch (2 a rank a step);
- ``fsdp-microbatch-2``: the same with both samples in one microbatch: the same gradient in exact arithmetic,
  other rounding: how far rounding alone moves this run;
- ``cp2``: context parallelism over the 2 ranks (each holds half of all 4 sequences: 4 microbatches a step).

The JSON has every step's loss and, against ``fsdp``, the largest loss difference and the largest weight
difference (relative to each tensor's largest weight) after each step.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from bench_utils import run_on_ranks, save_json
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from foundry.algorithms.gradient_clipping import GradientClipping
from foundry.core import LoggerDestination
from foundry.distributed import get_rank, init_process_group
from foundry.models.build import build_model
from foundry.optim import CosineWithWarmupScheduler, DecoupledAdamW
from foundry.trainer import Trainer

LLAMA = {"name": "llama_causal_lm", "d_model": 32, "n_heads": 4, "kv_n_heads": 2, "n_layers": 2, "vocab_size": 64,
         "max_seq_len": 16, "ffn_hidden_size": 64, "rope_theta": 100.0}  # fmt: skip
GLOBAL_BATCH, SEQ_LEN, DISTINCT_BATCHES, SEED = 4, 16, 3, 17
# name -> (context-parallel degree, samples a microbatch)
RUNS = {"fsdp": (1, 1), "fsdp-microbatch-2": (1, 2), "cp2": (2, 1)}


class Record(LoggerDestination):
    """Every step's loss and full weights (gathered from the shards); a destination also sees the events."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.weights: list[dict[str, torch.Tensor]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if "loss/train/total" in metrics:
            self.losses[step] = float(metrics["loss/train/total"])

    def batch_end(self, state, logger) -> None:
        weights = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True))
        self.weights.append({name: tensor.detach().float().clone() for name, tensor in weights.items()})


def rank_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """This rank's half of each step's global batch: 3 fixed random batches in turn."""
    generator = torch.Generator().manual_seed(0)
    distinct = [
        torch.randint(0, LLAMA["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=generator)
        for _ in range(DISTINCT_BATCHES)
    ]
    half = GLOBAL_BATCH // 2
    rank = get_rank()
    return [{"input_ids": distinct[step % DISTINCT_BATCHES][rank * half : (rank + 1) * half]} for step in range(steps)]


def train(name: str, args: argparse.Namespace) -> Record:
    cp, microbatch = RUNS[name]
    record = Record()
    torch.manual_seed(SEED)
    trainer = Trainer(
        model=build_model(LLAMA),
        train_dataloader=rank_batches(args.steps),
        max_duration=f"{args.steps}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-2, weight_decay=0.0, moments_dtype=args.moments),
        schedulers=CosineWithWarmupScheduler(t_warmup="5ba", alpha_f=0.1),
        algorithms=[GradientClipping("norm", 1.0)],
        fsdp_config={"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE"},
        parallelism={"context_parallel_degree": cp},
        device_train_microbatch_size=microbatch,
        precision=args.precision,
        device="cpu",
        seed=SEED,
        run_folder=f"/tmp/foundry-cp-rounding/{name}",
        log_to_console=False,
        loggers=[record],
    )
    trainer.fit()
    assert len(record.weights) == args.steps, "one record of the weights a step"
    return record


def against(run: Record, reference: Record) -> dict[str, Any]:
    steps = sorted(reference.losses)
    weight_differences = [
        max(((w[name] - r[name]).abs().max() / r[name].abs().max()).item() for name in r)
        for w, r in zip(run.weights, reference.weights, strict=True)
    ]
    return {
        "max_abs_loss_difference": max(abs(run.losses[s] - reference.losses[s]) for s in steps),
        "max_relative_weight_difference": max(weight_differences),
        "relative_weight_difference_by_step": weight_differences,
    }


def worker(args: argparse.Namespace) -> None:
    init_process_group()
    records = {name: train(name, args) for name in RUNS}
    if get_rank() != 0:
        return
    row = {
        "precision": args.precision,
        "moments": args.moments,
        "steps": args.steps,
        "losses": {name: record.losses for name, record in records.items()},
        **{f"{name} against fsdp": against(records[name], records["fsdp"]) for name in RUNS if name != "fsdp"},
    }
    save_json(args.out, f"cp_rounding_{args.precision}_{args.moments}_moments", [row])
    for name in RUNS:
        if name != "fsdp":
            summary = {k: v for k, v in row[f"{name} against fsdp"].items() if not k.endswith("by_step")}
            print(f"{name} against fsdp: {summary}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="amp_bf16", choices=["amp_bf16", "fp32"])
    parser.add_argument("--moments", default=None, help="Adam moments' dtype (default: bfloat16 in amp_bf16)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set on the torchrun ranks
    args = parser.parse_args()
    args.moments = args.moments or ("bfloat16" if args.precision == "amp_bf16" else "float32")
    if args.worker:
        worker(args)
        return 0
    worker_args = ["--precision", args.precision, "--moments", args.moments, "--steps", str(args.steps)]
    worker_args += ["--out", args.out] if args.out else []
    return run_on_ranks(__file__, 2, worker_args, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
