"""Every numeric key's range, from foundry.core.bounds: refused in a YAML and by the Python API alike."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import TinyLM, token_batches

from foundry.config import load_train_config
from foundry.core.bounds import BOUNDS, check_bounds
from foundry.data.finetuning import build_finetuning_dataloader
from foundry.data.text import build_text_dataloader
from foundry.errors import ConfigError
from foundry.trainer import Trainer

# (key, a value outside its range, a value inside it), for each key of the table.
CASES = [
    ("seed", -1, 0),
    ("seed", 2**64, 2**64 - 1),
    ("global_train_batch_size", 0, 1),
    ("device_train_microbatch_size", -2, "auto"),
    ("device_train_microbatch_size", 0, None),
    ("device_train_microbatch_size", 1.5, 1),
    ("device_eval_batch_size", 0, None),
    ("eval_subset_num_batches", 0, -1),
    ("eval_subset_num_batches", -2, 1),
    ("max_seq_len", 0, None),
    ("icl_seq_len", -8, 8),
    ("dist_timeout", 0.0, 0.5),
    ("save_num_checkpoints_to_keep", -5, -1),
    ("save_num_checkpoints_to_keep", -2, 0),
    ("save_upload_retries", -1, 0),
    ("save_upload_backoff_s", -0.5, 0.0),
    ("save_upload_backoff_s", float("nan"), 1.5),
    ("save_max_failed_uploads", 0, 1),
    ("num_workers", -1, 0),
    ("prefetch_factor", 0, None),
    ("timeout", -1.0, 0.0),
    ("timeout", float("inf"), 30.0),
]


def test_every_key_of_the_table_has_a_case():
    assert {key for key, _, _ in CASES} == set(BOUNDS)


@pytest.mark.parametrize(("key", "bad", "good"), CASES, ids=[f"{key}={bad}" for key, bad, _ in CASES])
def test_a_value_outside_its_range_is_refused_naming_the_key_and_the_range(key: str, bad: Any, good: Any):
    with pytest.raises(ConfigError, match=rf"'section\.{key}' is {bad!r}.*; it must be .*>"):
        check_bounds({key: bad}, "section")
    check_bounds({key: good}, "section")


YAML = """\
model: {name: tiny}
tokenizer: {name: t}
train_loader: {name: text, dataset: {local: data}}
optimizer: {name: decoupled_adamw}
max_duration: 10ba
global_train_batch_size: 8
"""


@pytest.mark.parametrize(
    ("override", "key_path"),
    [
        ("device_train_microbatch_size=-2", "device_train_microbatch_size"),
        ("device_train_microbatch_size=0", "device_train_microbatch_size"),
        ("save_num_checkpoints_to_keep=-5", "save_num_checkpoints_to_keep"),
        ("save_max_failed_uploads=0", "save_max_failed_uploads"),
        ("train_loader.num_workers=-1", "train_loader.num_workers"),
        ("train_loader.timeout=-3", "train_loader.timeout"),
    ],
)
def test_a_yaml_is_refused_when_parsed(tmp_path: Path, override: str, key_path: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(YAML))
    with pytest.raises(ConfigError, match=rf"'{key_path}' is -?\d"):
        load_train_config(path, [override])


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("device_train_microbatch_size", -2),
        ("device_train_microbatch_size", 0),
        ("save_num_checkpoints_to_keep", -5),
        ("eval_subset_num_batches", 0),
        ("seed", -1),
        ("save_upload_retries", -1),
        ("save_max_failed_uploads", 0),
    ],
)
def test_the_trainer_refuses_the_same_values(tmp_path: Path, key: str, bad: Any):
    with pytest.raises(ConfigError, match=rf"'{key}' is {bad}"):
        Trainer(TinyLM(), token_batches(1, 2), max_duration="1ba", run_folder=str(tmp_path), **{key: bad})


@pytest.mark.parametrize("builder", [build_text_dataloader, build_finetuning_dataloader])
def test_the_loader_builders_refuse_the_same_values(builder: Any):
    with pytest.raises(ConfigError, match=r"'eval_loader\.num_workers' is -1"):
        builder(device_batch_size=2, dataset={}, num_workers=-1, key_path="eval_loader")
