"""JSONLLogger: one JSON object per log call, readable back line by line; rank 0 unless all_ranks."""

from __future__ import annotations

import errno
import json

import pytest

from foundry import registry
from foundry.core import Event
from foundry.errors import TrainingError
from foundry.loggers import JSONLLogger


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_round_trip_of_hyperparameters_and_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_hyperparameters({"model": {"d_model": 64}, "max_duration": "10ba"})
    logger.log_metrics({"loss/train/total": 3.5}, step=1)
    logger.log_metrics({"loss/train/total": 3.25, "lr-AdamW/group0": 1e-3}, step=2)
    logger.close()
    assert _read(path) == [
        {"hyperparameters": {"model": {"d_model": 64}, "max_duration": "10ba"}},
        {"step": 1, "loss/train/total": 3.5},
        {"step": 2, "loss/train/total": 3.25, "lr-AdamW/group0": 1e-3},
    ]


def test_parent_folders_are_created(tmp_path):
    path = tmp_path / "runs" / "demo" / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"x": 1.0}, step=0)
    logger.close()
    assert path.is_file()


def test_lines_are_on_disk_after_batch_end(tmp_path, fire):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"x": 1.0}, step=1)
    fire(logger, Event.BATCH_END)
    assert _read(path) == [{"step": 1, "x": 1.0}]
    logger.close()


def test_an_existing_file_is_appended_to(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        logger = JSONLLogger(str(path))
        logger.log_metrics({"x": float(step)}, step=step)
        logger.close()
    assert [row["step"] for row in _read(path)] == [1, 2]


def test_nan_is_written_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"loss/train/total": float("nan")}, step=3)
    logger.close()
    assert _read(path) == [{"step": 3, "loss/train/total": None}]


def test_other_ranks_write_nothing_by_default(tmp_path, state, fire):
    state.rank = 1
    logger = JSONLLogger(str(tmp_path / "metrics.jsonl"))
    fire(logger, Event.FIT_START)
    logger.log_metrics({"x": 1.0}, step=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_all_ranks_writes_a_file_per_rank(tmp_path, state, fire):
    state.rank = 1
    logger = JSONLLogger(str(tmp_path / "metrics.jsonl"), all_ranks=True)
    fire(logger, Event.FIT_START)
    logger.log_metrics({"x": 1.0}, step=1)
    logger.close()
    assert _read(tmp_path / "metrics.rank1.jsonl") == [{"step": 1, "x": 1.0}]


def test_registered_as_jsonl():
    assert registry.loggers.get("jsonl") is JSONLLogger


def test_lines_are_on_disk_before_a_checkpoint(tmp_path, fire):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"loss/train/total": 1.0}, step=4)  # logged after BATCH_END, saved at batch 4
    fire(logger, Event.BEFORE_CHECKPOINT)
    assert _read(path) == [{"step": 4, "loss/train/total": 1.0}]
    logger.close()


def test_a_resumed_run_drops_the_lines_of_the_batches_it_trains_again(tmp_path, state, fire, advance):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"hyperparameters": {}}\n{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x": 3}\n{"st')
    logger = JSONLLogger(str(path))
    advance(2)  # resumed from the checkpoint of batch 2: a kill lost it after batch 3 was logged
    fire(logger, Event.AFTER_LOAD)
    logger.log_metrics({"x": 3.5}, step=3)
    logger.close()
    assert _read(path) == [{"hyperparameters": {}}, {"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 3.5}]


def test_a_run_restarted_from_scratch_drops_the_lines_of_its_killed_start(tmp_path, state, fire):
    # Killed before its first checkpoint, the relaunch trains batch 1 onwards again.
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"hyperparameters": {}}\n{"step": 0, "x": 0}\n{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n')
    logger = JSONLLogger(str(path))
    fire(logger, Event.AFTER_LOAD)
    logger.log_metrics({"x": 1.5}, step=1)
    logger.close()
    assert _read(path) == [{"hyperparameters": {}}, {"step": 0, "x": 0}, {"step": 1, "x": 1.5}]


def test_a_full_disk_names_the_file_and_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"x": 1.0}, step=1)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(logger._file, "flush", full)
    with pytest.raises(TrainingError, match=rf"Cannot write metrics to {path}: no space left on device .*run_folder"):
        logger.flush()
