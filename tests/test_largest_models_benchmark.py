"""benchmarks/largest_models.py's rows: each YAML with the benchmark's overrides is a valid config of the same
model on random weights (no training)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import largest_models

from foundry.config import load_train_config
from foundry.config.build import check_settings


@pytest.mark.parametrize("row", list(largest_models.ROWS))
def test_each_row_reads_the_prepared_samples_on_random_weights(row, tmp_path):
    yaml, gpus = largest_models.ROWS[row]
    args = argparse.Namespace(data=str(tmp_path), batches=6, warmup=2, smoke=False, set=["global_train_batch_size=8"])
    cfg = load_train_config(yaml, largest_models.row_overrides(args))[0]
    check_settings(cfg, world_size=gpus)
    shipped = load_train_config(yaml, [])[0]
    adapters, shipped_adapters = cfg.model.pop("peft_config"), shipped.model.pop("peft_config")
    assert cfg.model == shipped.model and cfg.fsdp_config == shipped.fsdp_config  # the YAML's model and layout
    assert adapters == {**shipped_adapters, "save_adapters_only": False}  # no base to save them beside
    assert not cfg.load_path and not cfg.save_folder
    assert cfg.train_loader.name == "text" and cfg.train_loader.dataset["max_seq_len"] == 4096
    assert cfg.train_loader.dataset["local"] == str(tmp_path.resolve() / "mds")
    assert (str(cfg.max_duration), cfg.callbacks["speed_monitor"]["warmup_batches"]) == ("6ba", 2)
    assert cfg.global_train_batch_size == 8  # --set
