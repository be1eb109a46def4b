"""A run writes only into a save_folder that is empty or holds its own checkpoints (foundry.checkpoint.owner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_trainer

from foundry.errors import ConfigError
from foundry.trainer import Trainer


def _trainer(folder: Path, run_name: str | None, **kwargs) -> Trainer:
    options = {"max_duration": "2ba", "autoresume": True, **kwargs}
    return tiny_trainer(
        folder, save_folder=str(folder / "checkpoints"), save_interval="1ba", run_name=run_name, **options
    )


@pytest.fixture
def saved_by_a(tmp_path: Path) -> Path:
    _trainer(tmp_path, "run-a").fit()
    return tmp_path


def test_another_named_run_is_refused_naming_both_runs_and_the_ways_out(saved_by_a):
    with pytest.raises(ConfigError) as refused:
        _trainer(saved_by_a, "run-b", max_duration="4ba")
    message = str(refused.value)
    assert "checkpoints of another run, 'run-a' (newest: ep0-ba2), and this run is 'run-b'" in message
    for way_out in ("new save_folder", "run_name: run-a", "save_overwrite: true", "checkpoints/ep0-ba2"):
        assert way_out in message


def test_the_same_run_resumes(saved_by_a):
    resumed = _trainer(saved_by_a, "run-a", max_duration="4ba")
    assert resumed.state.timestamp.batch == 2
    resumed.fit()
    assert resumed.state.timestamp.batch == 4


def test_a_run_without_a_name_of_its_own_resumes_as_before(tmp_path):
    _trainer(tmp_path, None).fit()
    assert _trainer(tmp_path, None, max_duration="4ba").state.timestamp.batch == 2


@pytest.mark.parametrize("run_name", ["run-a", "run-b", None])
def test_without_autoresume_a_folder_holding_checkpoints_is_refused_before_training(saved_by_a, run_name):
    with pytest.raises(ConfigError, match=r"without autoresume: it would train from batch 0.*autoresume: true"):
        _trainer(saved_by_a, run_name, autoresume=False)


@pytest.mark.parametrize(
    "options",
    [{"save_overwrite": True}, {"load_path": "{folder}/checkpoints/ep0-ba2", "autoresume": False}],
    ids=["save_overwrite", "load_path"],
)
def test_save_overwrite_or_load_path_let_another_run_write_there(saved_by_a, options):
    options = {
        key: str(value).format(folder=saved_by_a) if key == "load_path" else value for key, value in options.items()
    }
    _trainer(saved_by_a, "run-b", max_duration="4ba", **options).fit()
    checkpoints = saved_by_a / "checkpoints"
    latest = (checkpoints / "latest").read_text()
    assert latest == "ep0-ba4"
    assert json.loads((checkpoints / latest / "meta.json").read_text())["run"]["run_name"] == "run-b"
