"""Prompt text of each task type, 0-shot and few-shot, against hand-written strings."""

from __future__ import annotations

import random

from foundry.eval.prompts import build_prompts, fewshot_indices
from foundry.eval.task_config import ICLTaskConfig

LM_ROWS = [{"context": "The sky is", "continuation": "blue"}, {"context": "Grass is", "continuation": "green"}]
MC_ROWS = [
    {"query": "Q: 2+2?", "choices": ["4", "5"], "gold": 0},
    {"query": "Q: 3+3?", "choices": ["7", "6"], "gold": 1},
]
SCHEMA_ROWS = [
    {"context_options": ["Ann hit Bo because Ann", "Ann hit Bo because Bo"], "continuation": "was angry.", "gold": 0},
    {"context_options": ["Cy fed Di because Cy", "Cy fed Di because Di"], "continuation": "was hungry.", "gold": 1},
]
QA_ROWS = [
    {"context": "What is 1+1?", "answer": "2", "aliases": ["two"], "chain_of_thought": "One and one."},
    {"context": "What is 2+1?", "answer": "3", "chain_of_thought": "Two and one."},
]


def task(task_type: str, **keys: object) -> ICLTaskConfig:
    return ICLTaskConfig(label="t", dataset_uri="unused.jsonl", icl_task_type=task_type, **keys)  # type: ignore[arg-type]


def test_language_modeling_zero_shot_is_context_then_spaced_continuation() -> None:
    prompt = build_prompts(task("language_modeling"), LM_ROWS, 0, prefix_space=True)[0]
    assert (prompt.preamble, prompt.contexts, prompt.continuations) == ("", ["The sky is"], [" blue"])


def test_language_modeling_one_shot_prepends_the_other_solved_row() -> None:
    prompt = build_prompts(task("language_modeling", prompt_string="Facts:"), LM_ROWS, 1, prefix_space=True)[0]
    assert prompt.preamble + prompt.contexts[0] + prompt.continuations[0] == "Facts:\nGrass is green\nThe sky is blue"


def test_multiple_choice_few_shot_uses_delimiters_and_the_gold_answer() -> None:
    mc = task("multiple_choice", continuation_delimiter="\nA: ", example_delimiter="\n\n", question_prelimiter="> ")
    prompt = build_prompts(mc, MC_ROWS, 1, prefix_space=False)[1]
    assert prompt.preamble == "> Q: 2+2?\nA: 4"
    assert prompt.contexts == ["\n\n> Q: 3+3?\nA:"]  # trailing space stripped: it belongs to the choice
    assert prompt.continuations == ["7", "6"] and prompt.gold == 1


def test_multiple_choice_zero_shot_has_one_context_and_every_choice() -> None:
    prompt = build_prompts(task("multiple_choice"), MC_ROWS, 0, prefix_space=True)[0]
    assert (prompt.contexts, prompt.continuations, prompt.gold) == (["Q: 2+2?"], [" 4", " 5"], 0)


def test_schema_has_one_context_per_option_and_a_shared_continuation() -> None:
    prompt = build_prompts(task("schema"), SCHEMA_ROWS, 0, prefix_space=True)[0]
    assert prompt.contexts == ["Ann hit Bo because Ann", "Ann hit Bo because Bo"]
    assert prompt.continuations == [" was angry."] and prompt.gold == 0


def test_schema_few_shot_solves_the_shot_with_its_gold_option() -> None:
    prompt = build_prompts(task("schema"), SCHEMA_ROWS, 1, prefix_space=True)[0]
    assert prompt.preamble == "Cy fed Di because Di was hungry."
    assert prompt.contexts == ["\nAnn hit Bo because Ann", "\nAnn hit Bo because Bo"]


def test_generation_shots_show_chain_of_thought_then_answer() -> None:
    qa = task("generation_task_with_answers", continuation_delimiter="\nA: ", cot_delimiter=" So: ")
    prompt = build_prompts(qa, QA_ROWS, 1, prefix_space=True)[0]
    assert prompt.preamble == "What is 2+1?\nA: Two and one. So: 3"
    assert prompt.contexts == ["\nWhat is 1+1?\nA:"] and prompt.continuations == []
    assert prompt.answers == ["2", "two"]


def test_fewshot_sampling_never_picks_the_example_itself() -> None:
    rng = random.Random(1234)
    for index in range(20):
        shots = fewshot_indices(20, 19, index, rng)
        assert index not in shots and len(shots) == 19


def test_same_seed_gives_the_same_shots_and_another_seed_other_shots() -> None:
    rows = [{"context": f"c{i}", "continuation": f"x{i}"} for i in range(30)]
    first = [p.preamble for p in build_prompts(task("language_modeling"), rows, 3, prefix_space=False)]
    again = [p.preamble for p in build_prompts(task("language_modeling"), rows, 3, prefix_space=False)]
    other = [
        p.preamble for p in build_prompts(task("language_modeling", fewshot_random_seed=7), rows, 3, prefix_space=False)
    ]
    assert first == again and first != other


def test_limit_keeps_the_first_prompts_of_a_full_run() -> None:
    rows = [{"context": f"c{i}", "continuation": f"x{i}"} for i in range(30)]
    full = build_prompts(task("language_modeling"), rows, 3, prefix_space=False)
    limited = build_prompts(task("language_modeling"), rows, 3, prefix_space=False, limit=5)
    assert limited == full[:5]


def test_shots_come_in_llm_foundrys_set_order_not_sorted() -> None:
    # LLM Foundry iterates its sampled indices as a Python set; for these draws that order is not sorted.
    rng = random.Random(1234)
    shots = [fewshot_indices(100, 5, index, rng) for index in range(3)]
    assert shots == [[99, 74, 11, 14, 56], [4, 10, 12, 85, 88], [98, 3, 44, 45, 30]]


def test_schema_few_shot_puts_the_prelimiter_before_the_delimiter_as_llm_foundry() -> None:
    schema = task("schema", question_prelimiter="Q: ", example_delimiter="\n\n", continuation_delimiter=" -> ")
    prompt = build_prompts(schema, SCHEMA_ROWS, 1, prefix_space=True, limit=1)[0]
    assert prompt.preamble == "Q: Cy fed Di because Di -> was hungry."
    assert prompt.contexts == ["Q: \n\nAnn hit Bo because Ann ->", "Q: \n\nAnn hit Bo because Bo ->"]


def test_schema_zero_shot_context_has_no_continuation_delimiter() -> None:
    schema = task("schema", question_prelimiter="Q: ", continuation_delimiter=" -> ")
    prompt = build_prompts(schema, SCHEMA_ROWS, 0, prefix_space=True, limit=1)[0]
    assert prompt.contexts == ["Q: Ann hit Bo because Ann", "Q: Ann hit Bo because Bo"]


def test_every_answer_follows_a_chain_of_thought_when_any_row_has_one() -> None:
    rows = [{"context": "1+1?", "answer": "2", "chain_of_thought": "One and one."}, {"context": "2+1?", "answer": "3"}]
    qa = task("generation_task_with_answers", cot_delimiter=" So: ")
    prompt = build_prompts(qa, rows, 1, prefix_space=True, limit=1)[0]
    assert prompt.preamble == "2+1?  So: 3"  # the row without one writes '' before the delimiter
