"""Does the speed monitor's MFU agree with CUDA events over the same steps?

    python benchmarks/speed_monitor_check.py yamls/pretrain/mpt-1b.yaml --batches 30 --window 20 --out results/

Trains the YAML's model with the foundry Trainer on random tokens (amp_bf16, DecoupledAdamW,
microbatches of ``--microbatch``) with ``speed_monitor`` on. Independently, a callback records a
CUDA event at every BATCH_END; the GPU time between the events that bracket the speed monitor's
last window, with the same FLOPs, gives a second MFU. The speed monitor times on the host with no
syncs; the events time the device. They agree when the host clock over a window is honest.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_utils import model_from_yaml, random_batch, write_results

from foundry import Callback
from foundry.callbacks import SpeedMonitor
from foundry.callbacks.device_flops import device_peak_flops_per_sec
from foundry.core.callback import LoggerDestination
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer


class BatchEndEvents(Callback):
    """A CUDA event at every BATCH_END, and the model FLOPs of each batch."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []
        self.flops: list[int] = []

    def batch_end(self, state, logger) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        self.flops.append(state.model.flops_per_batch(state.batch))


class KeepMetrics(LoggerDestination):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))

    def last(self, key: str) -> float:
        return next(metrics[key] for _, metrics in reversed(self.rows) if key in metrics)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--override", nargs="*", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("speed_monitor_check.py needs a CUDA device.", file=sys.stderr)
        return 2
    model, seq_len = model_from_yaml(args.config, ["model.init_device=cuda", *args.override])
    vocab_size = model.config.vocab_size
    batches = [random_batch(args.batch_size, seq_len, vocab_size, torch.device("cpu")) for _ in range(args.batches)]
    events, metrics = BatchEndEvents(), KeepMetrics()
    trainer = Trainer(
        model=model,
        train_dataloader=batches,
        max_duration=f"{args.batches}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True),
        precision="amp_bf16",
        device="cuda",
        device_train_microbatch_size=args.microbatch,
        callbacks=[SpeedMonitor(window_size=args.window), events],
        loggers=[metrics],
        log_to_console=False,
        console_log_interval=f"{10 * args.batches}ba",  # the loss .item() would sync every batch
        run_folder="/tmp/speed_monitor_check",
    )
    trainer.fit()
    torch.cuda.synchronize()
    window = args.window
    event_s = events.events[-window - 1].elapsed_time(events.events[-1]) / 1e3
    window_flops = sum(events.flops[-window:])
    peak = device_peak_flops_per_sec(torch.device("cuda"), "amp_bf16")
    monitor_mfu = metrics.last("throughput/device/mfu")
    event_mfu = window_flops / event_s / peak
    rows = [{
        "config": args.config.rsplit("/", 1)[-1],
        "batch x seq": f"{args.batch_size} x {seq_len}",
        "microbatch": args.microbatch,
        "window_batches": window,
        "speed_monitor_mfu": monitor_mfu,
        "cuda_events_mfu": event_mfu,
        "relative_diff": abs(monitor_mfu - event_mfu) / event_mfu,
        "speed_monitor_tokens_per_s": metrics.last("throughput/tokens_per_sec"),
        "cuda_events_tokens_per_s": window * args.batch_size * seq_len / event_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }]  # fmt: skip
    write_results(args.out, "speed_monitor_check", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
