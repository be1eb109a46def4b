"""The hand_over callback: checkpoint and stop at each interval; a relaunch on any world size continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed.jobs import build_trainer, train
from foundry.callbacks.hand_over import HandOver, handed_over
from foundry.checkpoint import latest_checkpoint
from foundry.config import build as builders
from foundry.config import load_train_config
from foundry.errors import ConfigError, TrainingError

QUICKSTART = Path(__file__).resolve().parents[2] / "yamls" / "quickstart.yaml"


def test_hand_over_checkpoints_and_stops_at_the_interval(tmp_path):
    trainer = build_trainer(6, str(tmp_path), callbacks=[HandOver("2ba")], save_folder=str(tmp_path / "ckpt"))
    trainer.fit()
    assert trainer.state.stop_reason == "handed over at batch 2"
    assert latest_checkpoint(tmp_path / "ckpt").name == "ep0-ba2"
    assert handed_over(trainer.engine.callbacks)


def test_the_last_batch_finishes_instead_of_handing_over(tmp_path):
    trainer = build_trainer(2, str(tmp_path), callbacks=[HandOver("2ba")], save_folder=str(tmp_path / "ckpt"))
    trainer.fit()
    assert trainer.state.stop_reason is None
    assert not handed_over(trainer.engine.callbacks)


def test_hand_over_without_a_save_folder_fails(tmp_path):
    trainer = build_trainer(6, str(tmp_path), callbacks=[HandOver("2ba")])
    with pytest.raises(TrainingError, match="save_folder"):
        trainer.fit()


def test_hand_over_in_a_yaml_needs_a_save_folder():
    cfg, resolved = load_train_config(QUICKSTART, ["callbacks={hand_over: {interval: 2ba}}", "save_folder=null"])
    with pytest.raises(ConfigError, match="save_folder"):
        builders.build_trainer(cfg, resolved)


def test_switching_world_sizes_mid_run_matches_an_uninterrupted_run(ranks, tmp_path):
    """30 batches on 1 rank vs 10 on 2 ranks, 10 on 1, 10 on 2, handing over between them."""
    uninterrupted = ranks.run(1, train, 30, str(tmp_path / "a"))[0]
    folder = str(tmp_path / "b")
    relaunch = {"callbacks": [HandOver("10ba")], "save_folder": f"{folder}/ckpt", "autoresume": True}
    fsdp = {"sharding_strategy": "FULL_SHARD"}
    launches = [ranks.run(world_size, train, 30, folder, fsdp, **relaunch)[0] for world_size in (2, 1, 2)]

    assert [launch["stop_reason"] for launch in launches] == [
        "handed over at batch 10",
        "handed over at batch 20",
        None,
    ]
    losses = {step: loss for launch in launches for step, loss in launch["losses"].items()}
    assert sorted(losses) == list(range(1, 31))
    for step, loss in uninterrupted["losses"].items():
        assert losses[step] == pytest.approx(loss, abs=1e-4), step
    for name, weight in uninterrupted["weights"].items():
        torch.testing.assert_close(launches[-1]["weights"][name], weight, atol=1e-4, rtol=0, msg=name)
