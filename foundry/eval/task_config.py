"""The ICL eval's config: LLM Foundry's ``icl_tasks`` entries and ``eval_gauntlet`` categories, typed.

A train or eval YAML holds either the list / mapping itself, the path of a YAML file holding
``icl_tasks:`` / ``eval_gauntlet:``, or the name of one of LLM Foundry's lists (``light``, ``v0.3``:
foundry.icl_data fetches them); relative ``dataset_uri`` paths resolve against the current
directory, as in LLM Foundry. ``foundry.eval`` reads the rows and scores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from foundry.errors import ConfigError
from foundry.icl_data import task_list_path
from foundry.schema import parse_dataclass
from foundry.yaml_config import yaml_section

TaskType = Literal["language_modeling", "multiple_choice", "schema", "generation_task_with_answers"]
_TASK_TYPE_ALIASES = {"question_answering": "generation_task_with_answers"}  # LLM Foundry's old name


@dataclasses.dataclass(kw_only=True)
class ICLTaskConfig:
    """One entry of ``icl_tasks``; keys, meanings and defaults are LLM Foundry's."""

    label: str
    dataset_uri: str
    icl_task_type: TaskType
    num_fewshot: list[int] = field(default_factory=lambda: [0])
    prompt_string: str = ""  # once, before the few-shot examples
    example_delimiter: str = "\n"  # between examples
    continuation_delimiter: str = " "  # between an example's context and its answer
    question_prelimiter: str = ""  # before each context (few-shot ones too)
    cot_delimiter: str = ""  # generation: between chain of thought and the answer
    early_stopping_criteria: list[str] | None = None  # generation: text after these is cut off
    do_normalization: bool = True  # generation: compare lower-cased answers without punctuation/articles
    fewshot_random_seed: int = 1234
    has_categories: bool = False  # score each 'category' of the rows separately
    max_seq_len: int | None = None  # default: icl_seq_len
    batch_size: int | None = None  # rows per forward; default: device_eval_batch_size
    metric_names: list[str] | None = None  # accepted: every task reports its type's metrics (docs/EVAL.md)

    def __post_init__(self) -> None:
        if any(shots < 0 for shots in self.num_fewshot):
            raise ConfigError(f"icl task '{self.label}': num_fewshot {self.num_fewshot} must hold counts >= 0.")


def parse_icl_tasks(
    value: str | Path | Sequence[Mapping[str, Any]], key_path: str = "icl_tasks"
) -> list[ICLTaskConfig]:
    """``icl_tasks`` as typed configs; ``value`` is the list itself or a YAML file holding ``icl_tasks:``."""
    source = key_path
    if isinstance(value, str | Path):
        source = str(value)
        try:
            value = yaml_section(task_list_path(value, "icl_tasks"), "icl_tasks")
        except ConfigError as error:
            raise ConfigError(f"'{key_path}': {error}") from None
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"'{source}' must be a non-empty list of tasks (each with label, dataset_uri, icl_task_type)."
        )
    tasks = []
    for index, entry in enumerate(value):
        where = f"{source}[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"'{where}' must be a mapping of task keys, got {entry!r}.")
        entry = dict(entry)
        if entry.get("icl_task_type") in _TASK_TYPE_ALIASES:
            entry["icl_task_type"] = _TASK_TYPE_ALIASES[entry["icl_task_type"]]
        if isinstance(entry.get("num_fewshot"), int):
            entry["num_fewshot"] = [entry["num_fewshot"]]
        tasks.append(parse_dataclass(ICLTaskConfig, entry, where))
    labels = [task.label for task in tasks]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"'{source}': task labels must be unique; {', '.join(duplicates)} appear more than once.")
    return tasks


@dataclasses.dataclass(kw_only=True)
class Benchmark:
    name: str
    num_fewshot: int
    random_baseline: float = 0.0


@dataclasses.dataclass(kw_only=True)
class Category:
    name: str
    benchmarks: list[Benchmark]


@dataclasses.dataclass(kw_only=True)
class GauntletConfig:
    """LLM Foundry's ``eval_gauntlet`` keys."""

    categories: list[Category]
    weighting: Literal["EQUAL", "SAMPLE_SZ", "LOG_SAMPLE_SZ"] = "EQUAL"
    subtract_random_baseline: bool = True
    rescale_accuracy: bool = True
    averages: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rescale_accuracy and not self.subtract_random_baseline:
            raise ConfigError("eval_gauntlet: rescale_accuracy needs subtract_random_baseline: true.")
        names = {category.name for category in self.categories}
        for average, members in self.averages.items():
            unknown = sorted(set(members) - names)
            if unknown:
                raise ConfigError(f"eval_gauntlet.averages.{average} names unknown categories: {', '.join(unknown)}.")


def parse_gauntlet(value: str | Path | Mapping[str, Any], key_path: str = "eval_gauntlet") -> GauntletConfig:
    """The gauntlet config itself, or a YAML file holding ``eval_gauntlet:``."""
    if isinstance(value, str | Path):
        key_path, value = str(value), yaml_section(task_list_path(value, "eval_gauntlet"), "eval_gauntlet")
    return parse_dataclass(GauntletConfig, value, key_path)
