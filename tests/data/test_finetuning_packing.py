"""Packing in the finetuning loader: rows, boundaries, ranks, resume, and a tiny finetune end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.batches import IGNORE_INDEX
from foundry.cli import main
from foundry.data import build_finetuning_dataloader
from foundry.data.packing import pack_rows, profile_packing_ratio, rank_batches
from foundry.models.base import shifted_targets

REPO_ROOT = Path(__file__).resolve().parents[2]
SEQ = 48
ROWS = [{"prompt": f"Question {index}:", "response": " answer" * (1 + index % 4)} for index in range(24)]


@pytest.fixture
def rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return path


def build(tokenizer: Any, path: Path, batch_size: int = 2, **dataset: Any) -> Any:
    dataset = {"hf_name": str(path), "max_seq_len": SEQ, "packing_ratio": 3, "shuffle": True, **dataset}
    return build_finetuning_dataloader(tokenizer=tokenizer, device_batch_size=batch_size, dataset=dataset)


def test_packed_rows_hold_several_examples_with_restarting_positions(rows_file: Path, tiny_tokenizer: Any) -> None:
    batch = next(iter(build(tiny_tokenizer, rows_file)))
    sequence_id, positions = batch["sequence_id"][0], batch["position_ids"][0]
    assert sequence_id.max() >= 1
    for example in range(int(sequence_id.max()) + 1):
        assert positions[sequence_id == example].tolist() == list(range(int((sequence_id == example).sum())))
    assert torch.equal(batch["attention_mask"], (batch["sequence_id"] >= 0).long())


def test_an_epoch_packs_every_example_exactly_once(rows_file: Path, tiny_tokenizer: Any) -> None:
    loader = build(tiny_tokenizer, rows_file)
    packed = sorted(index for row in loader.rows for index in row)
    assert packed == list(range(len(ROWS)))
    assert len(loader.rows) < len(ROWS)


def test_no_token_predicts_the_next_examples_first_token(rows_file: Path, tiny_tokenizer: Any) -> None:
    batch = next(iter(build(tiny_tokenizer, rows_file, target_prompts="all")))
    targets = shifted_targets(batch)
    next_is_new_example = torch.roll(batch["sequence_id"], -1, dims=1) != batch["sequence_id"]
    assert (targets[next_is_new_example] == IGNORE_INDEX).all()
    same_example = ~next_is_new_example & (batch["sequence_id"] >= 0)
    same_example[:, -1] = False
    assert (targets[same_example] != IGNORE_INDEX).all()  # target_prompts: all trains on every other token


def test_epochs_reshuffle_the_packed_rows_but_keep_their_batch_count(rows_file: Path, tiny_tokenizer: Any) -> None:
    loader = build(tiny_tokenizer, rows_file)
    first, second = loader.epoch_batches(0), loader.epoch_batches(1)
    assert len(first) == len(second)
    assert first != second
    assert sorted(map(sorted, (row for batch in second for row in batch))) == sorted(map(sorted, loader.rows))


def test_pack_rows_carries_what_does_not_fit_to_the_next_step() -> None:
    rows = pack_rows(lengths=[6, 6, 6, 2, 2], order=[0, 1, 2, 3, 4], packing_ratio=2, rows_per_step=1, max_seq_len=8)
    assert rows == [[0], [1, 3], [2, 4]]


def test_auto_packing_ratio_is_the_highest_that_carries_nothing_over() -> None:
    lengths = [2, 6] * 20  # 4 examples (2 + 6 + 2 + 6) fill a row of 16 exactly
    assert profile_packing_ratio(lengths, list(range(40)), rows_per_step=2, max_seq_len=16) == 4.0


def test_packing_ratio_auto_packs_the_loader_without_carry_over(rows_file: Path, tiny_tokenizer: Any) -> None:
    loader = build(tiny_tokenizer, rows_file, packing_ratio="auto")
    assert loader.packing_ratio is not None and loader.packing_ratio > 1
    assert sorted(index for row in loader.rows for index in row) == list(range(len(ROWS)))


def test_every_rank_gets_the_same_number_of_disjoint_batches() -> None:
    rows = [[index] for index in range(7)]
    per_rank = [rank_batches(rows, 2, rank, 2, drop_last=False) for rank in range(2)]
    assert [len(batches) for batches in per_rank] == [2, 2]
    seen = [index for batches in per_rank for batch in batches for row in batch for index in row]
    assert sorted(seen) == list(range(7))
    assert [len(batches) for batches in (rank_batches(rows, 2, rank, 2, drop_last=True) for rank in range(2))] == [1, 1]


def test_state_dict_resumes_mid_epoch(rows_file: Path, tiny_tokenizer: Any) -> None:
    loader = build(tiny_tokenizer, rows_file)
    list(loader)  # into epoch 1, whose shuffle differs from epoch 0's
    full_epoch = [batch["input_ids"] for batch in loader]
    loader.load_state_dict({"epoch": 1, "batch_in_epoch": 0})
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    resumed = build(tiny_tokenizer, rows_file)
    resumed.load_state_dict(state)
    rest = [batch["input_ids"] for batch in resumed]
    assert len(rest) == len(full_epoch) - 1
    assert all(torch.equal(a, b) for a, b in zip(rest, full_epoch[1:], strict=True))


def test_state_after_an_epochs_last_batch_points_at_the_next_epoch(rows_file: Path, tiny_tokenizer: Any) -> None:
    loader = build(tiny_tokenizer, rows_file)
    batches = iter(loader)
    for _ in range(len(loader)):  # the Trainer stops here when max_duration ends with the epoch
        next(batches)
    assert loader.state_dict() == {"epoch": 1, "batch_in_epoch": 0}
    list(batches)
    assert loader.state_dict() == {"epoch": 1, "batch_in_epoch": 0}


def test_allow_pad_trimming_cuts_padding_to_a_multiple_of_8(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "response": " yes"}) + "\n", encoding="utf-8")
    batch = next(iter(build(tiny_tokenizer, path, batch_size=1, allow_pad_trimming=True, packing_ratio=None)))
    assert batch["input_ids"].shape[1] % 8 == 0
    assert batch["input_ids"].shape[1] < SEQ


def test_finetune_yaml_trains_a_tiny_model_with_packing(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    data = tmp_path / "instructions"
    assert main(["data", "convert", "--builtin-instructions", "--out", str(data), "--eval-fraction", "0.1"]) == 0
    run_folder = tmp_path / "run"
    overrides = [
        f"variables.data_local={data}", f"variables.tokenizer_dir={tiny_tokenizer_dir}", "variables.max_seq_len=64",
        "model.d_model=32", "model.n_layers=2", "model.vocab_size=320", "load_path=null", "max_duration=6ba",
        "eval_interval=6ba", "eval_first=false", "global_train_batch_size=4", "device_train_microbatch_size=4",
        "device_eval_batch_size=8", "eval_subset_num_batches=1", f"run_folder={run_folder}", "save_folder=null",
        "optimizer.lr=3e-3", "console_log_interval=1ba",
    ]  # fmt: skip
    assert main(["train", str(REPO_ROOT / "yamls" / "finetune" / "quickstart-finetune.yaml"), *overrides]) == 0
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss/train/total"] for row in rows if "loss/train/total" in row]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert any("metrics/eval/loss" in row for row in rows)
