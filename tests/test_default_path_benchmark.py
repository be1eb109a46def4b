"""benchmarks/default_path.py's --two-gpu rows: each is llama-8b.yaml with overrides the config accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import default_path

from foundry.config import load_train_config
from foundry.config.build import check_settings
from foundry.distributed.activation_checkpoint import checkpoint_plan


class MPTBlock(nn.Module):  # the class name the rows' checkpoint target names (foundry.models.mpt.MPTBlock)
    pass


def config_of(overrides: list[str]):
    launch = overrides.index("--nproc")
    yaml_overrides = overrides[:launch] + overrides[launch + 2 :]
    cfg, _ = load_train_config(default_path.REPO_ROOT / "yamls" / "pretrain" / "llama-8b.yaml", yaml_overrides)
    return cfg


def checkpointed_blocks(cfg) -> int | str:
    if cfg.fsdp_config.activation_checkpointing == "auto":  # chosen by the card's memory when the run starts
        return "auto"
    if not cfg.fsdp_config.activation_checkpointing:
        return 0
    blocks = [MPTBlock() for _ in range(cfg.model["n_layers"])]
    return sum(bool(modules) for modules in checkpoint_plan(blocks, cfg.model.get("activation_checkpointing_target")))


@pytest.mark.parametrize(
    ("label", "microbatch", "moments", "checkpointed"),
    [
        ("llama-8b as shipped", 4, "float32", "auto"),
        ("every block checkpointed", 4, "float32", 32),
        ("float8 (torchao), otherwise as shipped", 4, "float32", "auto"),
        ("bf16 moments, 20 of 32 blocks checkpointed", 4, "bfloat16", 20),
        ("microbatch 2, bf16 moments, 8 of 32 checkpointed", 2, "bfloat16", 8),
        ("bf16 moments, 16 of 32 checkpointed", 4, "bfloat16", 16),
        ("microbatch 2, bf16 moments, none checkpointed", 2, "bfloat16", 0),
    ],
)
def test_two_gpu_rows_set_what_their_labels_say(label: str, microbatch: int, moments: str, checkpointed) -> None:
    jobs = {job_label: (row, overrides, batches) for row, overrides, job_label, batches in default_path.two_gpu_jobs()}
    row, overrides, batches = jobs[label]
    assert row == "llama-8b" and batches == default_path.TWO_GPU_BATCHES
    assert overrides[overrides.index("--nproc") + 1] == "2"
    cfg = config_of(overrides)
    check_settings(cfg, world_size=2)  # what foundry train checks first: a target beside auto would be refused
    assert cfg.device_train_microbatch_size == microbatch and cfg.global_train_batch_size == 16
    assert cfg.optimizer.get("moments_dtype", "float32") == moments
    assert checkpointed_blocks(cfg) == checkpointed
