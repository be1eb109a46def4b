"""Tables of ICL results for one or several models: markdown (stdout), csv, json, and a bar chart.

``foundry eval --compare A B`` puts models side by side with each model's difference from the first
(the reference), e.g. a foundry-trained model against a published one of the same size and budget.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from pathlib import Path

from foundry.eval.gauntlet import primary_accuracy
from foundry.plotting import figure_class  # one place that says how to get matplotlib

GAUNTLET_PREFIX = "gauntlet/"


@dataclasses.dataclass
class ModelResults:
    """One model's results: ``{subtask: {metric: value}}`` and its gauntlet scores (if any)."""

    name: str
    results: dict[str, dict[str, float]]
    gauntlet: dict[str, float] = dataclasses.field(default_factory=dict)
    num_examples: dict[str, int] = dataclasses.field(default_factory=dict)  # examples scored per subtask

    def rows(self) -> dict[tuple[str, str], float]:
        """``{(row name, metric): value}``, gauntlet scores as ``(gauntlet/<category>, score)``."""
        rows = {(task, metric): value for task, metrics in self.results.items() for metric, value in metrics.items()}
        rows.update({(GAUNTLET_PREFIX + name, "score"): value for name, value in self.gauntlet.items()})
        return rows


def table_rows(models: list[ModelResults], deltas: bool) -> tuple[list[str], list[list[str]]]:
    """Header and rows (text) of the side-by-side table; deltas are each model minus the first."""
    names = [model.name for model in models]
    header = ["task", "metric", *names]
    if deltas:
        header += [f"{name} - {names[0]}" for name in names[1:]]
    per_model = [model.rows() for model in models]
    keys = list(dict.fromkeys(key for rows in per_model for key in rows))
    lines = []
    for key in keys:
        values = [rows.get(key, math.nan) for rows in per_model]
        line = [*key, *(_number(value) for value in values)]
        if deltas:
            line += [_number(value - values[0], signed=True) for value in values[1:]]
        lines.append(line)
    return header, lines


def _number(value: float, signed: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def markdown_table(models: list[ModelResults], deltas: bool = False) -> str:
    header, rows = table_rows(models, deltas)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_reports(models: list[ModelResults], out_dir: str | Path, deltas: bool = False) -> list[Path]:
    """``results.md``, ``results.csv``, ``results.json`` (and ``compare.png`` with ``deltas``) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header, rows = table_rows(models, deltas)
    text = io.StringIO()
    csv.writer(text).writerows([header, *rows])
    written = {
        "results.md": markdown_table(models, deltas),
        "results.csv": text.getvalue(),
        "results.json": json.dumps([dataclasses.asdict(model) for model in models], indent=2) + "\n",
    }
    paths = []
    for name, content in written.items():
        (out_dir / name).write_text(content)
        paths.append(out_dir / name)
    if deltas:
        paths.append(plot_comparison(models, out_dir / "compare.png"))
    return paths


def primary_scores(model: ModelResults) -> dict[str, float]:
    """Each subtask's primary accuracy, then the gauntlet average (what the bar chart shows)."""
    scores = {task: primary_accuracy(metrics) for task, metrics in model.results.items()}
    if "average" in model.gauntlet:
        scores[GAUNTLET_PREFIX + "average"] = model.gauntlet["average"]
    return {task: value for task, value in scores.items() if value is not None}


def plot_comparison(models: list[ModelResults], out_path: Path) -> Path:
    """Grouped bars: one group per task (primary accuracy) plus the gauntlet average, one bar per model."""
    scores = [primary_scores(model) for model in models]
    tasks = list(dict.fromkeys(task for model_scores in scores for task in model_scores))
    figure = figure_class()(figsize=(max(6.0, 0.6 * len(tasks) * len(models)), 4.5))
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / len(models)
    for index, (model, model_scores) in enumerate(zip(models, scores)):
        positions = [task_index + (index - (len(models) - 1) / 2) * width for task_index in range(len(tasks))]
        axes.bar(positions, [model_scores.get(task, math.nan) for task in tasks], width, label=model.name)
    axes.set_xticks(range(len(tasks)))
    axes.set_xticklabels(tasks, rotation=45, ha="right", fontsize=8)
    axes.set_ylabel("accuracy (gauntlet: above random baseline)")
    axes.axhline(0.0, color="black", linewidth=0.5)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    return out_path
