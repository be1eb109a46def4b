"""plot_curves: the run's own PNG at FIT_END, with the last batch in it; a warning, not a crash, without matplotlib."""

from __future__ import annotations

import sys

import pytest
from helpers import TinyLM, token_batches

from foundry import plotting, registry
from foundry.callbacks import plot_curves
from foundry.callbacks.plot_curves import PlotCurves
from foundry.core import Event, Logger
from foundry.loggers import JSONLLogger
from foundry.trainer import Trainer


def _fit(tmp_path, callback, num_batches=3):
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(num_batches, batch_size=2),
        max_duration=f"{num_batches}ba",
        callbacks=[callback],
        run_folder=str(tmp_path / "run"),
        log_to_console=False,
    )
    trainer.fit()
    return trainer


def test_is_registered_as_plot_curves():
    assert registry.callbacks.get("plot_curves") is PlotCurves


def test_a_fit_leaves_a_png_in_the_run_folder(tmp_path):
    callback = PlotCurves()
    _fit(tmp_path, callback)
    png = tmp_path / "run" / "curves.png"
    assert callback.out_path == png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000


def test_the_last_batch_loss_is_plotted(tmp_path, monkeypatch):
    plotted_steps = []

    def spy(run_dirs, out_path, metrics):
        plotted_steps.extend(step for step, _ in plotting.read_run(run_dirs[0])["loss/train/total"])
        return plotting.plot_runs(run_dirs, out_path, metrics)

    monkeypatch.setattr(plot_curves, "plot_runs", spy)
    _fit(tmp_path, PlotCurves(), num_batches=3)
    assert plotted_steps == [1, 2, 3]


def test_missing_matplotlib_warns_once(tmp_path, monkeypatch, state):
    jsonl = JSONLLogger(str(tmp_path / "metrics.jsonl"))
    jsonl.log_metrics({"loss/train/total": 3.0}, step=1)
    logger = Logger(state, [jsonl])
    callback = PlotCurves()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.warns(UserWarning, match=r"foundry\[plot\]") as warned:
        callback.run_event(Event.FIT_END, state, logger)
        callback.run_event(Event.FIT_END, state, logger)
    assert len(warned) == 1 and callback.out_path is None
    jsonl.close()
