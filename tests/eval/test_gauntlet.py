"""Gauntlet averaging: random baselines subtracted and rescaled, incomplete categories dropped."""

from __future__ import annotations

import math

import pytest

from foundry.errors import ConfigError
from foundry.eval.gauntlet import gauntlet_scores
from foundry.eval.metrics import LM_ACCURACY, MC_ACCURACY, MC_ACCURACY_RAW
from foundry.eval.task_config import parse_gauntlet

GAUNTLET = {
    "averages": {"core": ["knowledge"]},
    "categories": [
        {
            "name": "knowledge",
            "benchmarks": [
                {"name": "arc", "num_fewshot": 3, "random_baseline": 0.25},
                {"name": "jeopardy", "num_fewshot": 0, "random_baseline": 0.0},
            ],
        },
        {"name": "reasoning", "benchmarks": [{"name": "copa", "num_fewshot": 0, "random_baseline": 0.5}]},
    ],
}


def test_scores_subtract_and_rescale_the_random_baseline_and_average_categories() -> None:
    results = {
        "arc/3-shot": {MC_ACCURACY: 0.625, MC_ACCURACY_RAW: 0.0},  # the primary (normalised) accuracy counts
        "jeopardy/0-shot/history": {LM_ACCURACY: 0.2},
        "jeopardy/0-shot/science": {LM_ACCURACY: 0.4},  # categories average: 0.3
        "copa/0-shot": {MC_ACCURACY: 0.75},
    }
    scores = gauntlet_scores(parse_gauntlet(GAUNTLET), results)
    assert scores["knowledge"] == pytest.approx((0.5 + 0.3) / 2)  # (0.625 - 0.25) / 0.75 = 0.5
    assert scores["reasoning"] == pytest.approx(0.5)
    assert scores["core"] == pytest.approx(0.4)
    assert scores["average"] == pytest.approx(0.45)


def test_category_with_a_missing_benchmark_is_left_out() -> None:
    scores = gauntlet_scores(parse_gauntlet(GAUNTLET), {"copa/0-shot": {MC_ACCURACY: 1.0}})
    assert "knowledge" not in scores and "core" not in scores and scores["average"] == 1.0


def test_no_results_give_a_nan_average() -> None:
    assert math.isnan(gauntlet_scores(parse_gauntlet(GAUNTLET), {})["average"])


def test_average_of_unknown_category_is_refused() -> None:
    with pytest.raises(ConfigError, match="averages.core names unknown categories: nope"):
        parse_gauntlet({**GAUNTLET, "averages": {"core": ["nope"]}})


def test_light_gauntlet_matches_the_light_tasks(repo_root) -> None:
    from foundry.eval.task_config import parse_icl_tasks

    gauntlet = parse_gauntlet(repo_root / "yamls/eval/eval_gauntlet_light.yaml")
    tasks = {
        (task.label, shots)
        for task in parse_icl_tasks(repo_root / "yamls/eval/tasks_light.yaml")
        for shots in task.num_fewshot
    }
    benchmarks = {(b.name, b.num_fewshot) for category in gauntlet.categories for b in category.benchmarks}
    assert benchmarks <= tasks
