"""Scoring picks what a model prefers: rigged models choose the gold answer or avoid it, per task type."""

from __future__ import annotations

import pytest
import torch
from helpers import ByteTokenizer

from foundry.errors import DataError, TrainingError
from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.metrics import GENERATION_ACCURACY, LM_ACCURACY, MC_ACCURACY, MC_ACCURACY_RAW, GenerationAccuracy
from foundry.eval.task_config import parse_icl_tasks

MC_ROWS = [
    {"query": "Pick:", "choices": ["xyz", "qqq", "kkk"], "gold": 0},
    {"query": "Pick again:", "choices": ["ppp", "xyz", "mmm"], "gold": 1},
    {"query": "Last:", "choices": ["nnn", "jjj", "xyz"], "gold": 2},
]
SCHEMA_ROWS = [
    {"context_options": ["xyz", "qqq"], "continuation": "end", "gold": 0},
    {"context_options": ["kkk", "xyz"], "continuation": "end", "gold": 1},
]


def evaluator(write_jsonl, tokenizer, task_type: str, rows: list, **keys: object) -> ICLEvaluator:
    path = write_jsonl(f"{task_type}.jsonl", rows)
    tasks = parse_icl_tasks([{"label": "t", "dataset_uri": str(path), "icl_task_type": task_type, **keys}])
    return ICLEvaluator(tasks, tokenizer, seq_len=64, batch_size=4)


@pytest.mark.parametrize("num_fewshot", [0, 2])
def test_multiple_choice_picks_the_gold_choice_a_model_prefers(write_jsonl, byte_tokenizer, rigged_lm, num_fewshot):
    icl = evaluator(write_jsonl, byte_tokenizer, "multiple_choice", MC_ROWS, num_fewshot=[num_fewshot])
    results = icl.evaluate(rigged_lm("xyz"))[f"t/{num_fewshot}-shot"]
    assert results[MC_ACCURACY] == 1.0 and results[MC_ACCURACY_RAW] == 1.0


def test_multiple_choice_misses_the_gold_choice_a_model_avoids(write_jsonl, byte_tokenizer, rigged_lm) -> None:
    icl = evaluator(write_jsonl, byte_tokenizer, "multiple_choice", MC_ROWS)
    assert icl.evaluate(rigged_lm("xyz", bias=-5.0))["t/0-shot"][MC_ACCURACY] == 0.0


def test_raw_accuracy_favours_short_choices_where_normalised_does_not(write_jsonl, byte_tokenizer, rigged_lm) -> None:
    rows = [{"query": "Q", "choices": ["aaaaaa", "b"], "gold": 0}]  # 'a' is a little likelier than 'b' per token
    icl = evaluator(write_jsonl, byte_tokenizer, "multiple_choice", rows)
    results = icl.evaluate(rigged_lm("a", bias=0.5))["t/0-shot"]
    assert results[MC_ACCURACY] == 1.0 and results[MC_ACCURACY_RAW] == 0.0


def test_schema_picks_the_context_under_which_the_continuation_is_likeliest(
    write_jsonl, byte_tokenizer, triggered_lm
) -> None:
    model = triggered_lm(trigger="x", text="end")  # 'end' is likely only after a context containing 'x'
    icl = evaluator(write_jsonl, byte_tokenizer, "schema", SCHEMA_ROWS)
    assert icl.evaluate(model)["t/0-shot"][MC_ACCURACY] == 1.0


def test_schema_misses_when_the_gold_context_is_the_unlikely_one(write_jsonl, byte_tokenizer, triggered_lm) -> None:
    model = triggered_lm(trigger="x", text="end")
    rows = [{**row, "gold": 1 - row["gold"]} for row in SCHEMA_ROWS]
    assert evaluator(write_jsonl, byte_tokenizer, "schema", rows).evaluate(model)["t/0-shot"][MC_ACCURACY] == 0.0


def test_language_modeling_counts_only_exact_greedy_continuations(write_jsonl, byte_tokenizer, rigged_lm) -> None:
    rows = [{"context": "say", "continuation": "aaa"}, {"context": "say", "continuation": "aab"}]
    icl = evaluator(write_jsonl, byte_tokenizer, "language_modeling", rows)
    assert icl.evaluate(rigged_lm("a"))["t/0-shot"][LM_ACCURACY] == 0.5


def test_generation_stops_at_the_stop_string_and_matches_normalised_answers(
    write_jsonl, byte_tokenizer, rigged_lm
) -> None:
    rows = [{"context": "Q1", "answer": "A"}, {"context": "Q2", "answer": "b", "aliases": ["the a!"]}]
    icl = evaluator(write_jsonl, byte_tokenizer, "generation_task_with_answers", rows, early_stopping_criteria=["\n"])
    model = rigged_lm("a")  # writes 'aaaa...'; normalised answers 'a' and 'a' both prefix it
    assert icl.evaluate(model)["t/0-shot"][GENERATION_ACCURACY] == 1.0
    strict = evaluator(write_jsonl, byte_tokenizer, "generation_task_with_answers", rows, do_normalization=False)
    assert strict.evaluate(model)["t/0-shot"][GENERATION_ACCURACY] == 0.0


def test_categories_are_scored_separately(write_jsonl, byte_tokenizer, rigged_lm) -> None:
    rows = [
        {"context": "c", "continuation": "aa", "category": "easy"},
        {"context": "c", "continuation": "zz", "category": "hard"},
    ]
    icl = evaluator(write_jsonl, byte_tokenizer, "language_modeling", rows, has_categories=True)
    results = icl.evaluate(rigged_lm("a"))
    assert results["t/0-shot/easy"][LM_ACCURACY] == 1.0 and results["t/0-shot/hard"][LM_ACCURACY] == 0.0


def test_choices_of_one_question_share_a_batch_and_rows_are_sorted_longest_first(write_jsonl, byte_tokenizer):
    rows = [{"query": "q" * n, "choices": ["a", "bb", "c"], "gold": 0} for n in (3, 9, 5, 1)]
    icl = evaluator(write_jsonl, byte_tokenizer, "multiple_choice", rows)
    batches = icl.subtasks[0].batches
    assert [batch.rows_per_example for batch in batches] == [[3], [3], [3], [3]]  # 2 questions exceed 4 rows
    widths = [batch.input_ids.shape[1] for batch in batches]
    assert widths == sorted(widths, reverse=True)


def test_long_contexts_are_trimmed_from_the_left_to_fit(write_jsonl, byte_tokenizer) -> None:
    rows = [{"context": "x" * 100 + "END", "continuation": "yes"}]
    icl = evaluator(write_jsonl, byte_tokenizer, "language_modeling", rows)
    ((context, continuation),) = icl.subtasks[0].examples[0].requests
    assert len(context) + len(continuation) == 64 and bytes(context).endswith(b"END")


def test_without_normalisation_answers_match_with_surrounding_whitespace_stripped() -> None:
    metric = GenerationAccuracy(normalize=False)
    assert metric.is_correct(" Paris is the capital", [" Paris"]) and metric.is_correct("Paris\n", ["Paris "])
    assert not metric.is_correct(" paris", ["Paris"])  # case still counts without normalisation


def test_every_dataset_uri_is_checked_before_any_task_is_tokenized(write_jsonl) -> None:
    class CountingTokenizer(ByteTokenizer):
        calls = 0

        def __call__(self, text, add_special_tokens=True):
            CountingTokenizer.calls += 1
            return super().__call__(text, add_special_tokens)

    good = write_jsonl("good.jsonl", [{"context": "a", "continuation": "b"}] * 3)
    tasks = parse_icl_tasks(
        [
            {"label": "good", "dataset_uri": str(good), "icl_task_type": "language_modeling"},
            {"label": "lost", "dataset_uri": str(good.parent / "lost.jsonl"), "icl_task_type": "language_modeling"},
        ]
    )
    tokenizer = CountingTokenizer()
    with pytest.raises(DataError, match="'lost'.*lost.jsonl"):
        ICLEvaluator(tasks, tokenizer, seq_len=64, batch_size=4)
    assert CountingTokenizer.calls == 1  # needs_prefix_space's probe only


def test_a_model_that_computes_nan_is_never_scored(write_jsonl, byte_tokenizer, rigged_lm) -> None:
    icl = evaluator(write_jsonl, byte_tokenizer, "multiple_choice", MC_ROWS)
    model = rigged_lm("xyz")
    with torch.no_grad():
        model.weight.fill_(float("nan"))  # what uninitialised (or never loaded) weights compute
    with pytest.raises(TrainingError, match="NaN for 9 requests.*not reported"):
        icl.evaluate(model)
