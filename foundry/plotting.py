"""Read runs' ``metrics.jsonl`` and draw their curves: ``foundry plot RUN_DIR [RUN_DIR ...]``.

Example::

    foundry plot runs/baseline runs/bigger-lr -o compare.png --metrics loss/train/total,metrics/eval/loss

Drawing uses matplotlib's Agg canvas through ``Figure`` (not pyplot), so it never changes the process's
backend and works on machines without a display.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foundry.errors import DataError, FoundryError
from foundry.optional import import_optional

METRICS_FILE_NAME = "metrics.jsonl"
DEFAULT_METRICS = ("loss/train/total", "metrics/eval/loss", "throughput/tokens_per_sec")
_MARKER_MAX_POINTS = 30  # sparse series (eval every few hundred batches) get dots so single points show

Series = list[tuple[int, float]]  # (step, value), by increasing step


@dataclasses.dataclass(frozen=True)
class PlotSummary:
    """What ``plot_runs`` drew: the PNG, and for each subplot's metric the labels of its lines."""

    out_path: Path
    lines: dict[str, list[str]]


def metrics_path(run: str | Path) -> Path:
    """``run`` is a run folder holding metrics.jsonl, or a .jsonl file itself."""
    run = Path(run)
    return run if run.suffix == ".jsonl" else run / METRICS_FILE_NAME


def read_run(run_dir: str | Path) -> dict[str, Series]:
    """Every metric of a run's metrics.jsonl as ``{name: [(step, value), ...]}``.

    Hyperparameter rows are skipped; a NaN (written as null) is kept as NaN, a gap in the line. A step
    logged twice keeps its last value: a resumed run re-logs the batches after its checkpoint. The last
    line of a killed run may be cut short and is skipped; other unreadable lines are skipped with a warning.
    """
    path = metrics_path(run_dir)
    if not path.is_file():
        raise DataError(f"{path} does not exist: pass a run folder (the YAML's run_folder) or its metrics.jsonl.")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    by_step: dict[str, dict[int, float]] = {}
    unreadable = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):
                unreadable.append(number)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            for key, value in row.items():
                if key != "step" and _is_number_or_null(value):
                    by_step.setdefault(key, {})[row["step"]] = math.nan if value is None else float(value)
    if unreadable:
        warnings.warn(f"{path}: skipped unreadable lines {unreadable}.", stacklevel=2)
    return {key: sorted(points.items()) for key, points in by_step.items()}


def plot_runs(
    run_dirs: Sequence[str | Path], out_path: str | Path, metrics: Sequence[str] = DEFAULT_METRICS
) -> PlotSummary:
    """Draw one subplot per metric, one line per run (labelled by its folder's name), into a PNG.

    Runs without a metric have no line in its subplot; metrics no run has get no subplot.

    Raises:
        FoundryError: matplotlib is missing, or none of ``metrics`` appears in any run.
    """
    figure_type = figure_class()
    runs = dict(zip(_labels(run_dirs), (read_run(run) for run in run_dirs)))
    lines = {metric: [label for label, series in runs.items() if series.get(metric)] for metric in metrics}
    lines = {metric: labels for metric, labels in lines.items() if labels}
    if not lines:
        found = sorted(set().union(*runs.values()))
        raise FoundryError(
            f"Nothing to plot: none of {', '.join(metrics)} appears in {', '.join(map(str, run_dirs))}. "
            f"Metrics found: {', '.join(found) or 'none'}; choose some with --metrics a,b."
        )
    figure = figure_type(figsize=(8, 3 * len(lines)), layout="constrained")
    axes = figure.subplots(len(lines), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (metric, labels) in zip(axes, lines.items()):
        for label in labels:
            steps, values = zip(*runs[label][metric])
            ax.plot(steps, values, label=label, marker="o" if len(steps) <= _MARKER_MAX_POINTS else None)
        ax.set_title(metric)
        ax.ticklabel_format(axis="y", useOffset=False)  # '3.4911' rather than '1e-5 + 3.4911' on flat curves
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("batch")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)  # steps are batches: no 2.5 ticks
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=100)
    return PlotSummary(out_path=out_path, lines=lines)


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Each run's folder name; the path as given when two runs share a name."""
    names = [metrics_path(run).parent.name or str(run) for run in run_dirs]
    return [name if names.count(name) == 1 else str(run) for name, run in zip(names, run_dirs)]


def _is_number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def figure_class() -> type:
    module = import_optional(
        "matplotlib.figure", needed_for="Plotting", package="matplotlib", install="pip install 'foundry[plot]'"
    )
    return module.Figure


# ------------------------------------------------------------------------------- foundry plot
def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    parser.add_argument("-o", "--out", default=None, help="PNG to write (default: <first RUN_DIR>/curves.png)")
    parser.add_argument(
        "--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric names, one subplot each"
    )


def run_plot(args: argparse.Namespace) -> int:
    out_path = args.out or metrics_path(args.run_dirs[0]).parent / "curves.png"
    metrics = [name.strip() for name in args.metrics.split(",") if name.strip()]
    summary = plot_runs(args.run_dirs, out_path, metrics)
    drawn = "; ".join(f"{metric}: {len(labels)} run(s)" for metric, labels in summary.lines.items())
    print(f"foundry plot: wrote {summary.out_path} ({drawn})")
    return 0
