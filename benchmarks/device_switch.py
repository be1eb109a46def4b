"""Moving a run between CUDA and the CPU with the hand_over callback: do the losses follow an uninterrupted run?

Run A trains a small MPT for 30 batches on CUDA. Run B trains the same 30 batches in three launches:
10 on CUDA, hand over, 10 on the CPU, hand over, 10 on CUDA (real checkpoints, ``autoresume``). Both in
``amp_bf16`` (autocast also runs on the CPU) and in fp32 (TF32 off). Reports |loss B - loss A| per batch::

    python benchmarks/device_switch.py --out results/
    # CPU-only smoke test: --gpu-device cpu --d-model 64 --n-layers 2 --seq-len 32 --vocab-size 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch
from bench_utils import environment, write_results

from foundry.callbacks.hand_over import HandOver
from foundry.core.callback import LoggerDestination
from foundry.models import MPTCausalLM
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer

NUM_BATCHES, SEGMENT = 30, 10


class Losses(LoggerDestination):
    def __init__(self) -> None:
        self.by_batch: dict[int, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.by_batch[step] = float(metrics["loss/train/total"])


def run(args: argparse.Namespace, device: str, precision: str, folder: str, hand_over: bool, losses: Losses) -> None:
    torch.manual_seed(0)
    model = MPTCausalLM(
        d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers, vocab_size=args.vocab_size,
        max_seq_len=args.seq_len, attn_config={"attn_impl": "sdpa"},
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len)
    batches = [{"input_ids": torch.randint(0, args.vocab_size, shape, generator=generator)} for _ in range(NUM_BATCHES)]
    Trainer(
        model=model,
        train_dataloader=batches,
        max_duration=f"{NUM_BATCHES}ba",
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-3),
        precision=precision,
        device=device,
        callbacks=[HandOver(interval=f"{SEGMENT}ba")] if hand_over else [],
        loggers=[losses],
        save_folder=f"{folder}/checkpoints" if hand_over else None,
        save_interval=f"{NUM_BATCHES}ba",
        autoresume=hand_over,
        log_to_console=False,
        run_folder=f"{folder}/run",
    ).fit()


def compare(args: argparse.Namespace, precision: str) -> dict:
    gpu = args.gpu_device
    uninterrupted, switched = Losses(), Losses()
    run(args, gpu, precision, tempfile.mkdtemp(), hand_over=False, losses=uninterrupted)
    folder = tempfile.mkdtemp()
    for device in (gpu, "cpu", gpu):  # each launch trains one segment and hands over
        run(args, device, precision, folder, hand_over=True, losses=switched)
    diffs = [abs(switched.by_batch[b] - uninterrupted.by_batch[b]) for b in range(1, NUM_BATCHES + 1)]
    segments = {"cuda_1": diffs[:SEGMENT], "cpu": diffs[SEGMENT : 2 * SEGMENT], "cuda_2": diffs[2 * SEGMENT :]}
    row = {"precision": precision, **{f"max_diff_{name}": max(values) for name, values in segments.items()}}
    row["final_loss_A"] = uninterrupted.by_batch[NUM_BATCHES]
    row["final_loss_B"] = switched.by_batch[NUM_BATCHES]
    row["per_batch_diff"] = [round(d, 6) for d in diffs]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-device", default="cuda")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must be fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    rows = [compare(args, precision) for precision in ("amp_bf16", "fp32")]
    write_results(args.out, "device_switch", [{k: v for k, v in row.items() if k != "per_batch_diff"} for row in rows])
    if args.out:
        with open(f"{args.out}/device_switch_per_batch.json", "w") as file:
            json.dump({"environment": environment(), "rows": rows}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
