"""ICL accuracies as torchmetrics ``Metric``s: counts are summed over ranks when ``compute()`` syncs.

Names are LLM Foundry's metric class names, so dashboards and gauntlet configs carry over.
Multiple choice (and schema) report two accuracies: the primary one, as LLM Foundry's, picks the
choice with the highest mean log-likelihood per continuation token (length-normalised); the raw one
picks the highest total log-likelihood.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import torch
from torchmetrics import Metric

LM_ACCURACY = "InContextLearningLMAccuracy"
MC_ACCURACY = "InContextLearningMultipleChoiceAccuracy"
MC_ACCURACY_RAW = "InContextLearningMultipleChoiceAccuracyRaw"
GENERATION_ACCURACY = "InContextLearningGenerationExactMatchAccuracy"


class _CountingMetric(Metric):
    """``correct / total`` counters, summed across ranks."""

    full_state_update = False
    names: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        for name in self.names:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def compute(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) / self.total.clamp(min=1) for name in self.names}


class LanguageModelingAccuracy(_CountingMetric):
    """Share of examples whose whole continuation greedy decoding reproduces."""

    names = (LM_ACCURACY,)

    def update(self, greedy_match: torch.Tensor) -> None:
        self.InContextLearningLMAccuracy += greedy_match.double().sum()
        self.total += greedy_match.numel()


class MultipleChoiceAccuracy(_CountingMetric):
    """Share of questions whose gold choice is the most likely one (per token and in total)."""

    names = (MC_ACCURACY, MC_ACCURACY_RAW)

    def update(self, logprob_sums: Sequence[torch.Tensor], num_tokens: Sequence[torch.Tensor], golds: Sequence[int]):
        """One entry per question: each choice's summed log-likelihood and its token count."""
        for logprob_sum, count, gold in zip(logprob_sums, num_tokens, golds):
            self.InContextLearningMultipleChoiceAccuracy += float(int((logprob_sum / count).argmax()) == gold)
            self.InContextLearningMultipleChoiceAccuracyRaw += float(int(logprob_sum.argmax()) == gold)
            self.total += 1


class GenerationAccuracy(_CountingMetric):
    """Share of generations that, cut at a stop string and after ``cot_delimiter``, start with an answer."""

    names = (GENERATION_ACCURACY,)

    def __init__(self, stop_strings: Sequence[str] = (), cot_delimiter: str = "", normalize: bool = True) -> None:
        super().__init__()
        self.stop_strings = list(stop_strings)
        self.cot_delimiter = cot_delimiter
        self.normalize = normalize

    def update(self, generations: Sequence[str], answers: Sequence[Sequence[str]]) -> None:
        for generation, options in zip(generations, answers):
            self.InContextLearningGenerationExactMatchAccuracy += float(self.is_correct(generation, options))
            self.total += 1

    def is_correct(self, generation: str, answers: Sequence[str]) -> bool:
        if self.stop_strings:
            generation = re.split("|".join(map(re.escape, self.stop_strings)), generation)[0]
        if self.cot_delimiter:
            generation = generation.split(self.cot_delimiter)[-1]
        # Without normalisation, LLM Foundry still strips whitespace on both sides of both texts.
        clean = normalize_answer if self.normalize else str.strip
        return any(clean(generation).startswith(clean(answer)) for answer in answers)


_PUNCTUATION = set(string.punctuation) | {"‘", "’", "´", "`"}


def normalize_answer(text: str) -> str:
    """TriviaQA's normalisation: lower case, no punctuation or articles, single spaces."""
    text = "".join(" " if char in _PUNCTUATION else char for char in text.replace("_", " ").lower())
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())
