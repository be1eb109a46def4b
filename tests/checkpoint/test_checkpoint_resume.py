"""autoresume continues from the newest intact checkpoint, whatever an interrupted run or a damaged disk left."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from helpers import flip_byte, tiny_trainer, token_batches

from foundry.checkpoint import latest_checkpoint
from foundry.errors import CheckpointError, DamagedCheckpointError
from foundry.trainer import Trainer

NUM_BATCHES = 4


def _trainer(folder, **kwargs) -> Trainer:
    options = {"save_folder": str(folder / "checkpoints"), "save_interval": "1ba", "autoresume": True, **kwargs}
    return tiny_trainer(folder, batches=NUM_BATCHES, **options)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.state.model.state_dict().items()}


@pytest.fixture
def finished_run(tmp_path):
    """A run that saved ep0-ba1 .. ep0-ba4; returns its folder and its final weights."""
    trainer = _trainer(tmp_path)
    trainer.fit()
    return tmp_path, _weights(trainer)


def test_autoresume_falls_back_past_a_damaged_newest_checkpoint(finished_run, caplog):
    folder, final_weights = finished_run
    checkpoints = folder / "checkpoints"
    flip_byte(checkpoints / "ep0-ba4" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="foundry"):
        resumed = _trainer(folder)
    assert resumed.state.timestamp.batch == 3
    assert "skipped checkpoint" in caplog.text and "ep0-ba4" in caplog.text
    assert "__0_0.distcp differs from its checksum" in caplog.text and "ep0-ba4.damaged" in caplog.text
    assert (checkpoints / "ep0-ba4.damaged").is_dir()
    resumed.fit()  # retrains batch 4 and writes ep0-ba4 again: no "already exists" error
    assert latest_checkpoint(checkpoints).name == "ep0-ba4"
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, final_weights[name]), name


def test_autoresume_with_every_checkpoint_damaged_stops_and_says_so(tmp_path):
    trainer = _trainer(tmp_path, save_interval="4ba")
    trainer.fit()
    flip_byte(tmp_path / "checkpoints" / "ep0-ba4" / "meta.json")
    with pytest.raises(
        CheckpointError, match=r"no intact checkpoint.*ep0-ba4: meta.json differs.*start the run afresh"
    ):
        _trainer(tmp_path)
    assert (tmp_path / "checkpoints" / "ep0-ba4").is_dir()  # nothing is set aside when nothing can be resumed


def test_an_explicit_load_path_to_a_damaged_checkpoint_is_an_error(finished_run, tmp_path_factory):
    folder, _ = finished_run
    damaged = folder / "checkpoints" / "ep0-ba2"
    flip_byte(damaged / ".metadata")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    with pytest.raises(DamagedCheckpointError, match=r"ep0-ba2 is damaged: \.metadata differs"):
        _trainer(elsewhere, autoresume=False, load_path=str(damaged))


def test_resuming_a_finished_run_finishes_without_saving_again(finished_run):
    folder, _ = finished_run
    resumed = _trainer(folder)
    assert resumed.state.timestamp.batch == NUM_BATCHES
    resumed.fit()  # nothing left to train; the last checkpoint is already ours
    assert latest_checkpoint(folder / "checkpoints").name == f"ep0-ba{NUM_BATCHES}"


def test_the_trainer_removes_what_interrupted_saves_left(finished_run):
    folder, _ = finished_run
    leftover = folder / "checkpoints" / ".tmp-ep0-ba5-deadbeef"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")
    _trainer(folder)
    assert not leftover.exists()


@pytest.mark.parametrize("resume_at", [3, NUM_BATCHES], ids=["mid-run", "at-the-final-checkpoint"])
@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00\x9c garbage", b"ep0-ba99", b""], ids=["bytes", "unknown", "empty"])
def test_a_damaged_latest_pointer_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, garbage, resume_at):
    _trainer(tmp_path).fit()
    if resume_at < NUM_BATCHES:
        shutil.rmtree(tmp_path / "checkpoints" / f"ep0-ba{NUM_BATCHES}")
    pointer = tmp_path / "checkpoints" / "latest"
    pointer.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="foundry"):
        resumed = _trainer(tmp_path)
        resumed.fit()
    assert resumed.state.timestamp.batch == NUM_BATCHES
    assert pointer.read_text() == f"ep0-ba{NUM_BATCHES}"
    assert garbage == b"ep0-ba99" or f"Ignoring {pointer}" in caplog.text


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[1, 2]", b'{"format_version": 2}'], ids=["bytes", "list", "bare"])
def test_a_crafted_meta_json_with_a_matching_manifest_is_refused_naming_the_file(finished_run, resealed, content):
    folder, _ = finished_run
    checkpoint = folder / "checkpoints" / "ep0-ba4"
    (checkpoint / "meta.json").write_bytes(content)
    resealed(checkpoint)
    with pytest.raises(CheckpointError, match=r"meta\.json .*damaged"):
        _trainer(folder, autoresume=False, load_path=str(checkpoint))


@pytest.mark.parametrize(("key", "saved", "changed"), [("n_layers", 2, 4), ("d_model", 64, 32)])
def test_a_resume_with_a_changed_model_names_each_changed_key_and_the_ways_out(tmp_path, key, saved, changed):
    from helpers import TINY_MPT

    from foundry import registry

    def trainer(value: int) -> Trainer:
        model = registry.models.get("mpt_causal_lm")(**{**TINY_MPT, key: value})
        return Trainer(
            model=model,
            train_dataloader=token_batches(1, batch_size=2, vocab_size=96),
            max_duration="1ba",
            save_folder=str(tmp_path / "checkpoints"),
            autoresume=True,
            run_name="changed-model",
            run_folder=str(tmp_path / "run"),
            log_to_console=False,
            device="cpu",
            precision="fp32",
        )

    trainer(saved).fit()
    with pytest.raises(CheckpointError) as refused:
        trainer(changed)
    message = str(refused.value)
    assert f"{key}: {saved} in the checkpoint, {changed} in this run" in message
    assert "set the model's keys back" in message and "new save_folder and no load_path" in message
    assert "strict=False" not in message
