"""ICL task configs (LLM Foundry's ``icl_tasks:`` schema) and their jsonl rows, checked row by row.

A tasks YAML holds ``icl_tasks:`` (a list of task mappings); a train or eval YAML may hold the same
list inline or the path of such a file. Relative ``dataset_uri`` paths resolve against the current
directory, as in LLM Foundry; one that does not exist there but names one of LLM Foundry's files
(``eval/local_data/<category>/<file>.jsonl``) is fetched (``foundry.icl_data``). ``${variables.x}``
references work as in train YAMLs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from foundry.errors import ConfigError, DataError
from foundry.eval.task_config import ICLTaskConfig
from foundry.icl_data import local_file, recorded_path

# The fields each task type reads from a jsonl row, and their types.
REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "language_modeling": {"context": str, "continuation": str},
    "multiple_choice": {"query": str, "choices": list, "gold": int},
    "schema": {"context_options": list, "continuation": str, "gold": int},
    "generation_task_with_answers": {"context": str, "answer": str},
}


def local_task_files(tasks: Sequence[ICLTaskConfig]) -> list[ICLTaskConfig]:
    """``tasks`` reading local files: a missing file of LLM Foundry's (``eval/local_data/...``) is fetched.

    Fails, naming every task whose file is neither local nor LLM Foundry's, before any row is read.
    """
    resolved = []
    for task in tasks:
        recorded = recorded_path(task.dataset_uri)
        if recorded is not None and not Path(task.dataset_uri).expanduser().is_file():
            task = dataclasses.replace(task, dataset_uri=str(local_file(recorded)))
        resolved.append(task)
    check_dataset_uris(resolved)
    return resolved


def check_dataset_uris(tasks: Sequence[ICLTaskConfig]) -> None:
    """Fail, naming every task whose ``dataset_uri`` is remote or missing, before any task is read."""
    remote = [task for task in tasks if "://" in task.dataset_uri]
    if remote:
        raise ConfigError(
            f"icl task '{remote[0].label}': dataset_uri {remote[0].dataset_uri!r} is remote; foundry eval reads "
            "local jsonl files. Download it and give the local path."
        )
    missing = [task for task in tasks if not Path(task.dataset_uri).expanduser().is_file()]
    if missing:
        listed = "; ".join(f"'{task.label}': {Path(task.dataset_uri).expanduser()}" for task in missing)
        raise DataError(
            f"{len(missing)} of {len(tasks)} icl tasks name a dataset_uri that does not exist ({listed}); relative "
            f"paths resolve against {Path.cwd()}. Fix the paths in the tasks YAML (LLM Foundry's own files, paths "
            "ending in local_data/<category>/<file>.jsonl, are downloaded: foundry.icl_data)."
        )


def read_rows(task: ICLTaskConfig) -> list[dict[str, Any]]:
    """The task's jsonl rows, whitespace-stripped as LLM Foundry does; a bad row names the file and line."""
    check_dataset_uris([task])
    path = Path(task.dataset_uri).expanduser()
    required = REQUIRED_FIELDS[task.icl_task_type]
    rows = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            rows.append(_check_row(line, required, task, f"{path}:{line_number}"))
    if not rows:
        raise DataError(f"icl task '{task.label}': {path} holds no rows.")
    return rows


def _check_row(line: str, required: Mapping[str, Any], task: ICLTaskConfig, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg}); fix or delete the line.") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}.")
    for name, kind in required.items():
        if name not in row:
            raise DataError(
                f"{where}: the row has no '{name}' field, which {task.icl_task_type} tasks need "
                f"({', '.join(required)}); it has {', '.join(row) or 'no fields'}."
            )
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise DataError(f"{where}: '{name}' is {row[name]!r}; expected a {kind.__name__}.")
    if "gold" in required:
        options = row["choices"] if "choices" in row else row["context_options"]
        if not 0 <= row["gold"] < len(options):
            raise DataError(f"{where}: 'gold' is {row['gold']} but there are {len(options)} options.")
    if task.has_categories and not isinstance(row.get("category"), str):
        raise DataError(f"{where}: has_categories is set for '{task.label}' but the row has no 'category' string.")
    return {key: value.strip() if isinstance(value, str) else value for key, value in row.items()}


def split_by_category(rows: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    """``{category: rows}`` (sorted by category) for ``has_categories`` tasks."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["category"], []).append(row)
    return dict(sorted(groups.items()))
