"""End to end: the monitors' metrics reach metrics.jsonl through a real Trainer run."""

from __future__ import annotations

import json

import torch
from helpers import TinyLM

from foundry.callbacks import LRMonitor, RuntimeEstimator, SpeedMonitor
from foundry.loggers import JSONLLogger
from foundry.trainer import Trainer


def test_monitor_metrics_reach_the_jsonl_file(tmp_path):
    model = TinyLM(vocab_size=16)
    batches = [{"input_ids": torch.randint(0, 16, (2, 8))} for _ in range(4)]
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(
        model=model,
        train_dataloader=batches,
        max_duration="4ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[SpeedMonitor(window_size=2), LRMonitor(), RuntimeEstimator(skip_batches=1)],
        loggers=[JSONLLogger(str(path))],
        log_to_console=False,
        device="cpu",  # the assertion below is about a device without a known peak
    )
    trainer.fit()
    logged = set().union(*(json.loads(line).keys() for line in path.read_text().splitlines()))
    expected = {"throughput/tokens_per_sec", "throughput/device/flops_per_sec", "lr-SGD/group0"}
    assert expected | {"time/train", "time/remaining_estimate"} <= logged
    assert "throughput/device/mfu" not in logged  # CPU: no peak, no MFU
