"""A relaunch whose global batch, sequence length, data, optimizer or schedule differ from its checkpoint's is
refused naming each key and both values, unless autoresume_accept_changes says it is on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry.checkpoint.resume_check import changed_trained_keys
from foundry.cli import main
from foundry.data import convert_to_mds

QUICKSTART = Path(__file__).resolve().parents[2] / "yamls" / "quickstart.yaml"
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


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "quickstart"
    convert_to_mds(None, out, max_seq_len=32, vocab_size=512, progress=False)
    return out


def _train(folder: Path, data: Path, *overrides: str) -> int:
    tiny = ["model.d_model=32", "model.n_layers=1", "model.vocab_size=512", "variables.max_seq_len=32",
            "global_train_batch_size=8", "device_train_microbatch_size=8", "eval_first=false", "eval_interval=100ba",
            "callbacks={}", "save_interval=2ba", "autoresume=true", "algorithms={}"]  # fmt: skip
    paths = [f"variables.data_local={data}", f"run_folder={folder / 'run'}", f"save_folder={folder / 'ckpt'}"]
    return main(["train", str(QUICKSTART), *paths, *tiny, *overrides])


def test_a_relaunch_with_another_global_batch_is_refused_unless_accepted(tmp_path, data, capsys):
    assert _train(tmp_path, data, "max_duration=2ba") == 0
    capsys.readouterr()
    assert _train(tmp_path, data, "max_duration=4ba", "global_train_batch_size=16") == 2
    error = capsys.readouterr().err
    assert "global_train_batch_size: 8 in the checkpoint, 16 now" in error and "autoresume_accept_changes" in error
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba2"  # nothing trained

    changed = ["max_duration=4ba", "global_train_batch_size=16", "autoresume_accept_changes=true"]
    assert _train(tmp_path, data, *changed) == 0
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba4"
