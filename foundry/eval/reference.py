"""Scores to hold a model against when the reference model itself is not at hand: ``foundry eval --reference``.

A reference file lists, per reference model, the scores of its tasks and where each number comes from::

    references:
      - model: mpt-1b-published
        source: "the model card's table, 2023-05-05"
        scores:
          - {task: copa/0-shot, metric: InContextLearningMultipleChoiceAccuracy, value: 0.58}

Each of the evaluated model's subtasks that a reference lists is reported with its delta and, for an
accuracy, whether the delta is within sampling noise: two binomial standard errors of the reference's
accuracy over the examples the subtask scored, ``2 * sqrt(p (1 - p) / n)`` (a 95% interval for a model
of the reference's true accuracy). The verdict is PASS when every such accuracy is within noise (and
there is at least one), else FAIL: ``foundry eval --reference`` then exits ``EXIT_CHECK_FAILED`` (1).
``yamls/eval/reference_scores.yaml`` holds scores foundry measured for
its own quickstart model, with the command.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from foundry.errors import ConfigError
from foundry.eval.report import ModelResults
from foundry.schema import parse_dataclass
from foundry.yaml_config import yaml_section

NOISE_STANDARD_ERRORS = 2.0


@dataclasses.dataclass(kw_only=True)
class ReferenceScore:
    task: str  # a subtask name as foundry eval reports it, e.g. copa/0-shot
    metric: str
    value: float


@dataclasses.dataclass(kw_only=True)
class ReferenceModel:
    model: str
    source: str  # where the numbers come from: a command and date, or a publication
    scores: list[ReferenceScore]

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ConfigError(f"reference '{self.model}' has an empty source: say where its numbers come from.")


def load_references(path: str | Path) -> list[ReferenceModel]:
    """The reference models of a YAML file holding ``references:``."""
    entries = yaml_section(path, "references")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"'{path}': 'references' must be a non-empty list of {{model, source, scores}}.")
    return [parse_dataclass(ReferenceModel, entry, f"{path}: references[{i}]") for i, entry in enumerate(entries)]


@dataclasses.dataclass
class ReferenceDelta:
    task: str
    metric: str
    value: float
    reference: float
    num_examples: int | None
    noise: float | None  # two standard errors of the reference accuracy over num_examples; None if not an accuracy

    @property
    def delta(self) -> float:
        return self.value - self.reference

    @property
    def within_noise(self) -> bool | None:
        return None if self.noise is None else abs(self.delta) <= self.noise


def deltas(results: ModelResults, reference: ReferenceModel) -> list[ReferenceDelta]:
    """The reference's scores that ``results`` also has, with the model's value beside each."""
    found = []
    for score in reference.scores:
        value = results.results.get(score.task, {}).get(score.metric)
        if value is None:
            continue
        examples = results.num_examples.get(score.task)
        is_accuracy = "Accuracy" in score.metric and 0.0 <= score.value <= 1.0
        noise = None
        if is_accuracy and examples:
            noise = NOISE_STANDARD_ERRORS * math.sqrt(score.value * (1 - score.value) / examples)
        found.append(ReferenceDelta(score.task, score.metric, value, score.value, examples, noise))
    return found


def reference_table(results: ModelResults, reference: ReferenceModel) -> str:
    """Markdown: each shared subtask's value, the reference's, the delta and whether it is within noise."""
    rows = deltas(results, reference)
    lines = [
        f"{results.name} vs {reference.model} ({reference.source})",
        "",
        "| task | metric | value | reference | delta | examples | within noise (2 s.e.) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        noise = "-" if row.within_noise is None else f"{'yes' if row.within_noise else 'no'} (±{row.noise:.4f})"
        lines.append(
            f"| {row.task} | {row.metric} | {row.value:.4f} | {row.reference:.4f} | {row.delta:+.4f} | "
            f"{row.num_examples if row.num_examples is not None else '-'} | {noise} |"
        )
    if not rows:
        lines.append("| (no task in common) | | | | | | |")
    return "\n".join([*lines, "", verdict(rows)[1]]) + "\n"


def verdict(rows: list[ReferenceDelta]) -> tuple[bool, str]:
    """Whether every accuracy is within noise of the reference's (and one was checked), and a line saying so."""
    judged = [row for row in rows if row.within_noise is not None]
    outside = [row.task for row in judged if not row.within_noise]
    if not judged:
        return False, "FAIL: no accuracy in common with the reference, so nothing was checked."
    if outside:
        return False, f"FAIL: {len(outside)} of {len(judged)} accuracies outside the noise: {', '.join(outside)}."
    return True, f"PASS: {len(judged)} of {len(judged)} accuracies within the noise."
