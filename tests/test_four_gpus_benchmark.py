"""benchmarks/four_gpus.py's rows, guards and budget, with ``foundry train`` stood in for (no training)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import four_gpus

from foundry.config import load_train_config


def fake_train(outcomes: dict[str, int | None]):
    """A ``foundry_train`` that writes a run's metrics.jsonl and returns the row's outcome (None: cut off)."""

    def train(yaml, run_folder: Path, overrides, nproc, timeout_s, env):
        run_folder.mkdir(parents=True)
        (run_folder.parent / f"{run_folder.name}.log").write_text(
            "starting\ntorch.OutOfMemoryError: CUDA out of memory\n"
        )
        metrics = [
            {
                "step": 1,
                "loss/train/total": 9.0,
                "throughput/device/tokens_per_sec": 900.0,
                "memory/peak_allocated_mem": 70,
            }
        ]
        if outcomes[run_folder.name] == 0:
            metrics.append({"throughput/run/device/tokens_per_sec": 1000.0, "throughput/run/device/mfu": 0.5})
        cut_short = "" if outcomes[run_folder.name] == 0 else '{"step": 2, "loss/tra'  # killed mid-write
        (run_folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics) + cut_short)
        return outcomes[run_folder.name]

    return train


def run_rows(tmp_path: Path, rows: list[str], budget_s: float = 1e6) -> list[dict]:
    args = argparse.Namespace(rows=rows, data=str(tmp_path / "data"), budget_s=budget_s, work=str(tmp_path / "work"),
                              smoke=False, out=str(tmp_path / "out"))  # fmt: skip
    four_gpus.run(args)
    return json.loads((tmp_path / "out" / "four_gpus.json").read_text())


def test_a_row_that_fails_keeps_its_error_and_the_next_row_runs(tmp_path, monkeypatch) -> None:
    outcomes = {"llama-8b-128k": 1, "llama-8b-8k": 0}
    monkeypatch.setattr(four_gpus, "foundry_train", fake_train(outcomes))
    failed, passed = run_rows(tmp_path, ["llama-8b-128k", "llama-8b-8k"])
    assert failed["returncode"] == 1 and "out of memory" in failed["error"]
    assert passed["tokens_per_s_per_gpu"] == 1000.0 and passed["mfu"] == 0.5 and "error" not in passed
    assert (
        passed["command"].startswith("foundry train yamls/pretrain/llama-8b.yaml") and "--nproc 4" in passed["command"]
    )


def test_a_row_cut_off_keeps_its_last_batch(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(four_gpus, "foundry_train", fake_train({"llama-8b-256k": None}))
    (row,) = run_rows(tmp_path, ["llama-8b-256k"])
    assert row["partial"] and row["tokens_per_s_per_gpu"] == 900.0 and row["batches_logged"] == 1
    assert row["error"] == "cut off at the time left"


def test_a_row_longer_than_the_budget_left_is_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(four_gpus, "foundry_train", fake_train({"llama-8b-8k": 0}))
    skipped, ran = run_rows(tmp_path, ["llama-8b-256k", "llama-8b-8k"], budget_s=300)
    assert skipped["error"].startswith("skipped") and ran["returncode"] == 0


@pytest.mark.parametrize("name", four_gpus.ROWS)
def test_each_row_reads_its_dataset_and_smoke_drops_the_gpu_keys(name) -> None:
    overrides = four_gpus.row_overrides(name, Path("/data"), smoke=False)
    folder = four_gpus.DATASETS[four_gpus.ROWS[name].dataset][0]
    assert f"variables.data_local=/data/{folder}" in overrides
    smoke = four_gpus.row_overrides(name, Path("/data"), smoke=True)
    assert four_gpus.GPU_INIT not in smoke and "parallelism.context_parallel_degree=1" in smoke


@pytest.mark.parametrize("name", [name for name in four_gpus.ROWS if name.startswith("llama-8b-8k")])
def test_the_8k_rows_checkpoint_every_block_as_they_were_measured(name) -> None:
    """llama-8b.yaml ships activation_checkpointing: auto, which checkpoints no block on 141 GB cards."""
    overrides = four_gpus.row_overrides(name, Path("/data"), smoke=False)
    cfg, _ = load_train_config(four_gpus.REPO_ROOT / four_gpus.ROWS[name].yaml, overrides)
    assert cfg.fsdp_config.activation_checkpointing is True and "activation_checkpointing_target" not in cfg.model
    assert cfg.max_seq_len == 8192 and cfg.device_train_microbatch_size == 1


def test_a_float8_row_that_fell_back_to_bf16_says_so(tmp_path, monkeypatch) -> None:
    def trained_in_bf16(yaml, run_folder: Path, overrides, nproc, timeout_s, env) -> int:
        fake_train({run_folder.name: 0})(yaml, run_folder, overrides, nproc, timeout_s, env)
        (run_folder.parent / f"{run_folder.name}.log").write_text("algorithms.float8: ...; this run trains in bf16.\n")
        return 0

    monkeypatch.setattr(four_gpus, "foundry_train", trained_in_bf16)
    (row,) = run_rows(tmp_path, ["llama-8b-8k-float8"])
    assert row["returncode"] == 0 and row["error"] == "float8 fell back to bf16"
