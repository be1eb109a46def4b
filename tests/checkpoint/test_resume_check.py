"""A relaunch whose global batch, sequence length, data, optimizer or schedule differ from its checkpoint's is
refused naming each key and both values, unless autoresume_accept_changes says it is on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_trainer

from foundry.checkpoint.resume_check import changed_trained_keys
from foundry.errors import ConfigError
from foundry.trainer import Trainer

RECORDED = {
    "global_train_batch_size": 8,
    "max_seq_len": 128,
    "optimizer": {"name": "decoupled_adamw", "lr": 3e-3, "betas": [0.9, 0.95]},
    "scheduler": {"name": "cosine_with_warmup", "t_warmup": "20ba"},
    "train_loader": {"name": "text", "dataset": {"local": "data", "shuffle": True}, "num_workers": 0},
    "eval_interval": "50ba",
    "console_log_interval": "1ba",
}


def test_settings_that_do_not_change_what_is_trained_pass():
    current = {**RECORDED, "eval_interval": "10ba", "console_log_interval": "5ba", "precision": "amp_bf16"}
    current["train_loader"] = {**RECORDED["train_loader"], "num_workers": 8}
    assert changed_trained_keys(RECORDED, current) == []


def test_each_changed_key_is_named_with_both_values():
    current = {**RECORDED, "global_train_batch_size": 16, "max_seq_len": 64}
    current["optimizer"] = {**RECORDED["optimizer"], "lr": 1e-3}
    current["train_loader"] = {**RECORDED["train_loader"], "dataset": {"local": "other", "shuffle": True}}
    assert changed_trained_keys(RECORDED, current) == [
        ("global_train_batch_size", 8, 16),
        ("max_seq_len", 128, 64),
        ("optimizer.lr", 3e-3, 1e-3),
        ("train_loader.dataset.local", "data", "other"),
    ]


def test_a_key_added_or_removed_counts_as_a_change():
    current = {**RECORDED, "scheduler": {"name": "cosine_with_warmup", "t_warmup": "20ba", "alpha_f": 0.1}}
    assert changed_trained_keys(RECORDED, current) == [("scheduler.alpha_f", None, 0.1)]


def test_a_tuple_equals_its_json_list_and_none_equals_a_missing_key():
    recorded = {**RECORDED, "seed": None}  # meta.json: lists, and null where a key was unset
    current = {key: value for key, value in RECORDED.items() if key != "seed"}
    current["optimizer"] = {**RECORDED["optimizer"], "betas": (0.9, 0.95)}  # a Python config's tuple
    assert changed_trained_keys(recorded, current) == []


def _trainer(folder: Path, config: dict, max_duration: str, **settings) -> Trainer:
    return tiny_trainer(
        folder, seed=None, max_duration=max_duration, save_folder=str(folder / "ckpt"), save_interval="2ba",
        autoresume=True, config=config, **settings,
    )  # fmt: skip


def test_a_relaunch_with_another_global_batch_is_refused_unless_accepted(tmp_path):
    _trainer(tmp_path, {**RECORDED}, "2ba").fit()
    changed = {**RECORDED, "global_train_batch_size": 16, "eval_interval": "1ba"}
    with pytest.raises(ConfigError, match="global_train_batch_size: 8 in the checkpoint, 16 now") as refused:
        _trainer(tmp_path, changed, "4ba")
    assert "autoresume_accept_changes: true" in str(refused.value) and "eval_interval" not in str(refused.value)
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba2"  # nothing trained

    _trainer(tmp_path, changed, "4ba", autoresume_accept_changes=True).fit()
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba4"


def test_a_python_run_without_a_config_resumes_unchecked(tmp_path):
    _trainer(tmp_path, None, "2ba").fit()
    _trainer(tmp_path, None, "4ba").fit()
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba4"
