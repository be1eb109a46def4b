"""foundry builds LLM Foundry's ICL prompts token for token (fixture: tests/eval/fixtures/llmfoundry_prompts.json).

The fixture holds what LLM Foundry 0.22's own ICL datasets built from ../shared/data's jsonl files and
the GPT-NeoX tokenizer (as it is, and made to add BOS): every request's context and continuation ids
for the first rows of each subtask (language modeling, multiple choice, schema and generation, 0-shot
and few-shot, with categories), written by tests/eval/fixtures/make_llmfoundry_prompts.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from foundry.eval.evaluator import ICLEvaluator, Subtask
from foundry.eval.task_config import ICLTaskConfig

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIXTURE = json.loads((FIXTURES / "llmfoundry_prompts.json").read_text())
request_digest = _fixture_module("make_llmfoundry_prompts").request_digest


@pytest.fixture(scope="module")
def tokenizers(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The GPT-NeoX tokenizer of the shared data folder, as it is and made to add BOS."""
    from transformers import AutoTokenizer

    tokenizer_dir = shared_data / "tokenizers" / "gpt-neox-20b"
    bos_dir = _fixture_module("tokenizer_variants").write_bos_variant(tokenizer_dir, tmp_path_factory.mktemp("bos"))
    plain, with_bos = AutoTokenizer.from_pretrained(tokenizer_dir), AutoTokenizer.from_pretrained(bos_dir)
    plain.pad_token_id = with_bos.pad_token_id = FIXTURE["pad_token_id"]
    return {"gpt-neox-20b": plain, "gpt-neox-20b+bos": with_bos}


def _task_groups() -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Fixture entries by (tokenizer, label, shots): a categorised task has one entry per category."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for entry in FIXTURE["subtasks"]:
        groups.setdefault((entry["tokenizer"], entry["label"], entry["num_fewshot"]), []).append(entry)
    return groups


GROUPS = _task_groups()


def _foundry_subtasks(entries: list[dict[str, Any]], tokenizer: Any, shared_data: Path) -> list[Subtask]:
    first = entries[0]
    task = ICLTaskConfig(
        label=first["label"],
        dataset_uri=str(shared_data / "icl" / first["dataset_uri"]),
        icl_task_type=first["icl_task_type"],
        num_fewshot=[first["num_fewshot"]],
        **first["keys"],
    )
    limit = max(len(entry["digests"]) for entry in entries)
    return ICLEvaluator([task], tokenizer, FIXTURE["max_seq_len"], batch_size=8, limit=limit).subtasks


@pytest.mark.parametrize("key", sorted(GROUPS), ids=lambda key: f"{key[1]}-{key[2]}shot-{key[0]}")
def test_prompt_ids_equal_llm_foundrys(
    key: tuple[str, str, int], tokenizers: dict[str, Any], shared_data: Path
) -> None:
    entries = GROUPS[key]
    subtasks = _foundry_subtasks(entries, tokenizers[key[0]], shared_data)
    expected_names = [f"{key[1]}/{key[2]}-shot" + (f"/{e['category']}" if e["category"] else "") for e in entries]
    assert [subtask.name for subtask in subtasks] == expected_names
    for subtask, entry in zip(subtasks, entries, strict=True):
        ours = [[[list(ctx), list(cont)] for ctx, cont in example.requests] for example in subtask.examples]
        for index, expected in enumerate(entry["full_ids"]):
            assert ours[index] == expected, f"{subtask.name} example {index}"
        mismatched = [i for i, digest in enumerate(entry["digests"]) if request_digest(ours[i]) != digest]
        assert not mismatched, f"{subtask.name}: examples {mismatched[:10]} differ from LLM Foundry's"
        if "max_new_tokens" in entry:
            assert subtask.max_new_tokens == entry["max_new_tokens"]


def test_fixture_covers_every_task_type_at_zero_and_few_shots() -> None:
    covered = {(entry["icl_task_type"], entry["num_fewshot"] > 0) for entry in FIXTURE["subtasks"]}
    types = ("language_modeling", "multiple_choice", "schema", "generation_task_with_answers")
    assert covered == {(task_type, few) for task_type in types for few in (False, True)}
    assert sum(len(entry["digests"]) for entry in FIXTURE["subtasks"]) >= 500
