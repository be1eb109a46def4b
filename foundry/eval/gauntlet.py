"""The eval gauntlet: ICL accuracies averaged into categories, as LLM Foundry's ``eval_gauntlet`` YAML says.

Each benchmark's score is its accuracy minus its random baseline, divided by ``1 - baseline``
(``subtract_random_baseline``, ``rescale_accuracy``); a category is the weighted mean of its
benchmarks' scores, dropped when any benchmark is missing; ``average`` is the mean of categories,
and each entry of ``averages`` the mean of the categories it lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from foundry.errors import ConfigError
from foundry.eval.metrics import GENERATION_ACCURACY, LM_ACCURACY, MC_ACCURACY
from foundry.eval.task_config import GauntletConfig

PRIMARY_METRICS = (MC_ACCURACY, LM_ACCURACY, GENERATION_ACCURACY)


def primary_accuracy(metrics: Mapping[str, float]) -> float | None:
    """The accuracy a subtask is judged by (length-normalised for multiple choice)."""
    return next((metrics[name] for name in PRIMARY_METRICS if name in metrics), None)


def gauntlet_scores(
    config: GauntletConfig, results: Mapping[str, Mapping[str, float]], sizes: Mapping[str, int] | None = None
) -> dict[str, float]:
    """``{category: score, ..., average name: score, "average": score}`` from ``evaluate()`` results.

    A benchmark's accuracy is the mean over its categories when its task has ``has_categories``.
    ``sizes`` (examples per result key) is needed for the SAMPLE_SZ weightings.
    """
    scores: dict[str, float] = {}
    for category in config.categories:
        weighted = []
        for benchmark in category.benchmarks:
            prefix = f"{benchmark.name}/{benchmark.num_fewshot}-shot"
            keys = [key for key in results if key == prefix or key.startswith(prefix + "/")]
            accuracies = [primary_accuracy(results[key]) for key in keys]
            accuracies = [value for value in accuracies if value is not None]
            if not accuracies:
                break
            score = sum(accuracies) / len(accuracies)
            if config.subtract_random_baseline:
                score -= benchmark.random_baseline
            if config.rescale_accuracy:
                score /= 1.0 - benchmark.random_baseline
            weighted.append((score, _weight(config.weighting, sum((sizes or {}).get(key, 0) for key in keys))))
        else:
            total = sum(weight for _, weight in weighted)
            scores[category.name] = sum(score * weight for score, weight in weighted) / total
    for name, members in config.averages.items():
        if all(member in scores for member in members):
            scores[name] = sum(scores[member] for member in members) / len(members)
    categories = [scores[c.name] for c in config.categories if c.name in scores]
    scores["average"] = sum(categories) / len(categories) if categories else math.nan
    return scores


def _weight(weighting: str, num_examples: int) -> float:
    if weighting == "EQUAL":
        return 1.0
    if num_examples < 1:
        raise ConfigError(f"eval_gauntlet.weighting {weighting} needs the benchmarks' sizes; use EQUAL.")
    return float(num_examples) if weighting == "SAMPLE_SZ" else max(math.log2(num_examples), 1.0)
