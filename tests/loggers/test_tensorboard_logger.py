"""TensorboardLogger: scalars by step and the config as text, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import TinyLM, token_batches

from foundry import registry
from foundry.core import Event
from foundry.errors import ConfigError
from foundry.loggers import TensorboardLogger
from foundry.trainer import Trainer

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(log_dir):
    accumulator = event_accumulator.EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def test_is_registered_as_tensorboard():
    assert registry.loggers.get("tensorboard") is TensorboardLogger


def test_a_fit_writes_the_logged_losses_by_step(tmp_path):
    run_folder = tmp_path / "run"
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(3, batch_size=2),
        max_duration="3ba",
        loggers=[TensorboardLogger(log_dir=str(tmp_path / "tb"))],
        run_folder=str(run_folder),
        log_to_console=False,
    )
    trainer.fit()
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["loss/train/total"] for row in rows if "loss/train/total" in row}
    scalars = _read(tmp_path / "tb").Scalars("loss/train/total")
    assert {event.step: event.value for event in scalars} == pytest.approx(logged, rel=1e-6)  # stored as float32


def test_the_config_is_logged_as_text_with_secrets_redacted(tmp_path):
    logger = TensorboardLogger(log_dir=str(tmp_path))
    logger.log_hyperparameters({"model": {"d_model": 64}, "hf_token": "hf_abcdefgh12345678"})
    logger.close()
    (text_event,) = _read(tmp_path).Tensors("config/text_summary")
    text = text_event.tensor_proto.string_val[0].decode()
    assert "d_model: 64" in text and "hf_abcdefgh12345678" not in text


def test_log_dir_defaults_to_the_run_folder(tmp_path, monkeypatch, state, fire):
    monkeypatch.chdir(tmp_path)
    state.run_name = "demo"
    logger = TensorboardLogger()
    fire(logger, Event.INIT)
    logger.log_metrics({"x": 1.0}, step=1)
    logger.close()
    assert list((tmp_path / "runs" / "demo" / "tensorboard").glob("events.out.tfevents.*"))


def test_other_ranks_write_nothing(tmp_path, state, fire):
    state.rank = 1
    logger = TensorboardLogger(log_dir=str(tmp_path / "tb"))
    fire(logger, Event.INIT)
    logger.log_metrics({"x": 1.0}, step=1)
    logger.close()
    assert not (tmp_path / "tb").exists()


def test_missing_tensorboard_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'foundry\[tensorboard\]'"):
        TensorboardLogger()
