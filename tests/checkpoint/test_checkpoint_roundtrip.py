"""Save then load gives back the same run: weights, optimizer, schedules, time, RNG, stateful parts."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from helpers import assert_nested_close

from foundry.checkpoint import load_checkpoint, save_checkpoint
from foundry.core import Callback
from foundry.errors import CheckpointError


class BestLoss(Callback):
    def __init__(self) -> None:
        self.best = float("inf")

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]


class CountingLoader:
    """A dataloader that remembers how far it got, like streaming's StreamingDataLoader."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        return iter(())

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_load_restores_parameters_exactly(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    resumed = new_state(seed=1)
    load_checkpoint(tmp_path, resumed)
    assert_nested_close(resumed.model.state_dict(), trained_state.model.state_dict())  # same names, exact values


def test_load_restores_optimizer_state_exactly(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    resumed = new_state(seed=1)
    load_checkpoint(tmp_path, resumed)
    saved, loaded = trained_state.optimizers[0].state_dict(), resumed.optimizers[0].state_dict()
    for param_id, param_state in saved["state"].items():
        for key, value in param_state.items():
            assert torch.equal(value, loaded["state"][param_id][key]), key
    assert loaded["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]


def test_resumed_training_matches_uninterrupted_training(tmp_path, trained_state, new_state, train_steps):
    save_checkpoint(tmp_path, trained_state)
    train_steps(trained_state, 2)
    resumed = new_state(seed=1)
    load_checkpoint(tmp_path, resumed)
    train_steps(resumed, 2)
    assert_nested_close(resumed.model.state_dict(), trained_state.model.state_dict())


def test_load_restores_timestamp_and_scheduler(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    resumed = new_state()
    load_checkpoint(tmp_path, resumed)
    assert resumed.timestamp == trained_state.timestamp
    assert resumed.schedulers[0].last_epoch == trained_state.schedulers[0].last_epoch == 3
    assert resumed.schedulers[0].get_last_lr() == trained_state.schedulers[0].get_last_lr()


def test_random_numbers_after_load_continue_as_after_save(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    after_save = (torch.rand(4), random.random(), np.random.rand(3))
    load_checkpoint(tmp_path, new_state())
    after_load = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(after_save[0], after_load[0])
    assert after_save[1] == after_load[1]
    assert np.array_equal(after_save[2], after_load[2])


def test_missing_rank_rng_file_falls_back_to_rank0_and_says_so(tmp_path, trained_state, new_state, caplog):
    save_checkpoint(tmp_path, trained_state)
    expected = torch.rand(4)
    resumed = new_state()
    resumed.rank, resumed.world_size = 1, 2
    with caplog.at_level(logging.WARNING):
        load_checkpoint(tmp_path, resumed)
    assert torch.equal(torch.rand(4), expected)
    assert "rng-rank0.json" in caplog.text


def test_weights_only_loads_model_and_nothing_else(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    fresh = new_state(seed=1)
    load_checkpoint(tmp_path, fresh, weights_only=True)
    assert torch.equal(fresh.model[0].weight, trained_state.model[0].weight)
    assert fresh.timestamp.batch == 0
    assert fresh.optimizers[0].state_dict()["state"] == {}


def test_callback_and_dataloader_state_round_trip(tmp_path, trained_state, new_state):
    callback, loader = BestLoss(), CountingLoader()
    callback.best, loader.position = 1.25, 7
    trained_state.train_dataloader = loader
    save_checkpoint(tmp_path, trained_state, callbacks=[callback])
    resumed, resumed_callback = new_state(), BestLoss()
    resumed.train_dataloader = CountingLoader()
    load_checkpoint(tmp_path, resumed, callbacks=[resumed_callback])
    assert resumed_callback.best == 1.25
    assert resumed.train_dataloader.position == 7


def test_meta_keeps_config_and_run_info(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state, config={"model": {"d_model": 8}})
    meta = load_checkpoint(tmp_path, new_state())
    assert meta["config"] == {"model": {"d_model": 8}}
    assert meta["run"]["world_size"] == 1
    assert meta["run"]["device_type"] == "cpu"
    assert meta["run"]["torch_version"] == torch.__version__


def test_non_json_callback_state_is_refused_naming_the_callback(tmp_path, trained_state):
    callback = BestLoss()
    callback.best = torch.tensor(1.0)
    with pytest.raises(CheckpointError, match=r"BestLoss\.state_dict\(\)"):
        save_checkpoint(tmp_path, trained_state, callbacks=[callback])


def test_model_mismatch_names_the_keys(tmp_path, trained_state, new_state):
    save_checkpoint(tmp_path, trained_state)
    other = new_state()
    other.model.append(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing \['3.bias', '3.weight'\].*new save_folder"):
        load_checkpoint(tmp_path, other, weights_only=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_model_and_random_numbers_round_trip(tmp_path, trained_state, new_state):
    trained_state.model.cuda()
    trained_state.device = torch.device("cuda")
    torch.cuda.manual_seed(3)
    save_checkpoint(tmp_path, trained_state)
    after_save = torch.rand(4, device="cuda")
    resumed = new_state(seed=1)
    resumed.model.cuda()
    meta = load_checkpoint(tmp_path, resumed, weights_only=False)
    assert torch.equal(torch.rand(4, device="cuda"), after_save)
    assert torch.equal(resumed.model[0].weight, trained_state.model[0].weight)
    assert meta["run"]["device_type"] == "cuda"
