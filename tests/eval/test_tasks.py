"""Task configs and jsonl rows: bad input names the key, the file and the line."""

from __future__ import annotations

import pytest

from foundry.errors import ConfigError, DataError
from foundry.eval.task_config import parse_icl_tasks
from foundry.eval.tasks import read_rows


def one_task(path: object, task_type: str = "multiple_choice", **keys: object):
    return parse_icl_tasks([{"label": "t", "dataset_uri": str(path), "icl_task_type": task_type, **keys}])[0]


def test_bad_json_row_names_file_and_line(write_jsonl) -> None:
    path = write_jsonl("bad.jsonl", [{"query": "q", "choices": ["a"], "gold": 0}, "{not json"])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        read_rows(one_task(path))


def test_row_missing_a_field_names_the_field_and_line(write_jsonl) -> None:
    path = write_jsonl("missing.jsonl", [{"query": "q", "gold": 0}])
    with pytest.raises(DataError, match=rf"{path}:1: the row has no 'choices' field"):
        read_rows(one_task(path))


def test_gold_outside_the_choices_is_refused(write_jsonl) -> None:
    path = write_jsonl("gold.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 2}])
    with pytest.raises(DataError, match=rf"{path}:1: 'gold' is 2 but there are 2 options"):
        read_rows(one_task(path))


def test_missing_dataset_file_says_where_relative_paths_resolve(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist.*relative paths resolve against"):
        read_rows(one_task(tmp_path / "nope.jsonl"))


def test_misspelt_task_key_suggests_the_right_one(tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=r"icl_tasks\[0\].continuation_delimeter.*Did you mean 'continuation_delimiter'"
    ):
        one_task(tmp_path / "x.jsonl", continuation_delimeter=": ")


def test_unknown_task_type_lists_the_supported_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match="icl_task_type.*'language_modeling'"):
        one_task(tmp_path / "x.jsonl", task_type="code_evaluation")


def test_single_fewshot_count_and_old_type_name_are_accepted(tmp_path) -> None:
    task = one_task(tmp_path / "x.jsonl", task_type="question_answering", num_fewshot=3)
    assert task.num_fewshot == [3] and task.icl_task_type == "generation_task_with_answers"


def test_tasks_yaml_resolves_variables(tmp_path) -> None:
    (tmp_path / "tasks.yaml").write_text(
        "variables: {root: /data}\nicl_tasks:\n- {label: a, dataset_uri: '${variables.root}/a.jsonl', "
        "icl_task_type: schema}\n"
    )
    assert parse_icl_tasks(tmp_path / "tasks.yaml")[0].dataset_uri == "/data/a.jsonl"


def test_duplicate_labels_are_refused(tmp_path) -> None:
    task = {"label": "a", "dataset_uri": "a.jsonl", "icl_task_type": "schema"}
    with pytest.raises(ConfigError, match="labels must be unique; a"):
        parse_icl_tasks([task, task])
