"""foundry plot: reading runs' metrics.jsonl (killed and resumed runs included) and drawing one PNG."""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys

import pytest

from foundry.errors import DataError, FoundryError
from foundry.plotting import add_plot_arguments, plot_runs, read_run, run_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(folder, rows, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row) + "\n" for row in rows) + tail
    (folder / "metrics.jsonl").write_text(text)
    return folder


def _train_rows(losses, eval_every=0):
    rows = [{"hyperparameters": {"seed": 17}}]
    for step, loss in enumerate(losses, start=1):
        rows.append({"step": step, "loss/train/total": loss, "throughput/tokens_per_sec": 1000.0 + step})
        if eval_every and step % eval_every == 0:
            rows.append({"step": step, "metrics/eval/loss": loss + 0.1})
    return rows


def _png_height(path):
    # IHDR is the first chunk: 8-byte signature, 4-byte length, 'IHDR', then width and height.
    return struct.unpack(">II", path.read_bytes()[16:24])[1]


def test_read_run_groups_values_by_metric_and_skips_hyperparameters(tmp_path):
    run = _write_run(tmp_path / "a", _train_rows([3.0, 2.5], eval_every=2))
    series = read_run(run)
    assert series["loss/train/total"] == [(1, 3.0), (2, 2.5)]
    assert series["metrics/eval/loss"] == [(2, 2.6)]
    assert "hyperparameters" not in series


def test_read_run_tolerates_a_truncated_last_line(tmp_path):
    run = _write_run(tmp_path / "killed", _train_rows([3.0, 2.5]), tail='{"step": 3, "loss/tra')
    assert read_run(run)["loss/train/total"] == [(1, 3.0), (2, 2.5)]


def test_read_run_keeps_the_resumed_value_of_a_relogged_step(tmp_path):
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 2, "x": 20.0}]
    assert read_run(_write_run(tmp_path / "resumed", rows))["x"] == [(1, 1.0), (2, 20.0)]


def test_read_run_reads_null_as_nan(tmp_path):
    ((step, value),) = read_run(_write_run(tmp_path / "nan", [{"step": 4, "loss/train/total": None}]))[
        "loss/train/total"
    ]
    assert step == 4 and math.isnan(value)


def test_a_missing_run_folder_is_a_data_error_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="metrics.jsonl"):
        read_run(tmp_path / "nope")


def test_a_run_without_eval_has_no_line_in_the_eval_subplot(tmp_path):
    with_eval = _write_run(tmp_path / "with_eval", _train_rows([3.0, 2.5, 2.0, 1.5], eval_every=2))
    without_eval = _write_run(tmp_path / "without_eval", _train_rows([3.1, 2.9]))
    summary = plot_runs([with_eval, without_eval], tmp_path / "out.png")
    assert summary.lines == {
        "loss/train/total": ["with_eval", "without_eval"],
        "metrics/eval/loss": ["with_eval"],
        "throughput/tokens_per_sec": ["with_eval", "without_eval"],
    }


def test_plot_command_writes_a_png_with_one_subplot_per_metric_beside_the_first_run(tmp_path, capsys):
    first = _write_run(tmp_path / "first", _train_rows([3.0, 2.5], eval_every=1))
    second = _write_run(tmp_path / "second", _train_rows([3.2, 2.4]))
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    assert run_plot(parser.parse_args([str(first), str(second)])) == 0
    png = first / "curves.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    assert _png_height(png) == 3 * 3 * 100  # three 3-inch subplots at 100 dpi
    assert "metrics/eval/loss: 1 run(s)" in capsys.readouterr().out


def test_plot_command_draws_only_the_metrics_asked_for(tmp_path):
    run = _write_run(tmp_path / "run", _train_rows([3.0, 2.5]))
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    run_plot(parser.parse_args([str(run), "-o", str(tmp_path / "loss.png"), "--metrics", "loss/train/total"]))
    assert _png_height(tmp_path / "loss.png") == 3 * 100


def test_no_data_at_all_is_an_error_listing_the_metrics_found(tmp_path):
    run = _write_run(tmp_path / "run", [{"step": 1, "lr-AdamW/group0": 1e-3}])
    with pytest.raises(FoundryError, match="Metrics found: lr-AdamW/group0"):
        plot_runs([run], tmp_path / "out.png")


def test_missing_matplotlib_names_the_pip_command(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run", _train_rows([3.0]))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(FoundryError, match=r"pip install 'foundry\[plot\]'"):
        plot_runs([run], tmp_path / "out.png")
