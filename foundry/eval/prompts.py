"""Prompt text of each ICL example: LLM Foundry's layout, few-shot sampling with a fixed seed.

Every prompt is ``preamble + context + continuation`` where the preamble is ``prompt_string``
followed by ``num_fewshot`` solved examples drawn (without the example itself) from the same rows::

    {prompt_string}{prelimiter}{ctx_1}{continuation_delimiter}{answer_1}{example_delimiter}...
    {example_delimiter}{prelimiter}{ctx}{continuation_delimiter.rstrip()}   <- scored context
    {" " if the tokenizer needs it}{continuation}                          <- scored continuation

Multiple choice has one context and a continuation per choice; schema has a context per option and
one continuation; generation has one context and no continuation (the model writes it).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from foundry.eval.tasks import ICLTaskConfig


@dataclasses.dataclass
class PromptedExample:
    """One row as text. ``contexts`` × ``continuations`` are the scored pairs (one side has length 1)."""

    preamble: str  # prompt_string and the few-shot examples
    contexts: list[str]
    continuations: list[str]  # empty for generation
    gold: int | None = None  # index of the right pair (MC: the choice; schema: the context)
    answers: list[str] = dataclasses.field(default_factory=list)  # generation: answer and aliases


def fewshot_indices(num_rows: int, num_fewshot: int, example_index: int, rng: random.Random) -> list[int]:
    """``num_fewshot`` distinct row indices other than ``example_index`` (LLM Foundry's sampling), sorted."""
    num_fewshot = min(num_rows - 1, num_fewshot)
    chosen = set(rng.sample(range(num_rows), num_fewshot))
    if example_index in chosen:
        chosen.remove(example_index)
        replacement = rng.choice(range(num_rows))
        while replacement in chosen or replacement == example_index:
            replacement = rng.choice(range(num_rows))
        chosen.add(replacement)
    return sorted(chosen)


def build_prompts(
    task: ICLTaskConfig, rows: list[dict[str, Any]], num_fewshot: int, prefix_space: bool, limit: int | None = None
) -> list[PromptedExample]:
    """The rows of ``task`` as prompts with ``num_fewshot`` examples; the same seed gives the same shots.

    Args:
        prefix_space: whether continuations need a leading space to tokenize as they would mid-text
            (GPT-2 style BPE tokenizers do; SentencePiece ones do not).
        limit: prompt only the first ``limit`` rows (shots are still drawn from all rows, so these
            prompts are exactly the first ones of a full run).
    """
    layout = _LAYOUTS[task.icl_task_type](task)
    rng = random.Random(task.fewshot_random_seed)
    prompts = []
    for index, row in enumerate(rows[:limit]):
        preamble = task.prompt_string
        if num_fewshot > 0:
            for shot in fewshot_indices(len(rows), num_fewshot, index, rng):
                preamble += (task.example_delimiter if preamble else "") + layout.solved(rows[shot])
        delimiter = task.example_delimiter if preamble else ""
        contexts = [f"{delimiter}{context}".rstrip() for context in layout.contexts(row)]
        continuations = [_with_prefix_space(text, prefix_space) for text in layout.continuations(row)]
        prompts.append(PromptedExample(preamble, contexts, continuations, row.get("gold"), layout.answers(row)))
    return prompts


def _with_prefix_space(text: str, prefix_space: bool) -> str:
    return f" {text}" if prefix_space and not text.startswith(" ") else text


class _Layout:
    """How one task type writes a row: as a solved few-shot example, as contexts, as continuations."""

    def __init__(self, task: ICLTaskConfig) -> None:
        self.task = task

    def context(self, text: str) -> str:
        return f"{self.task.question_prelimiter}{text}{self.task.continuation_delimiter}"

    def solved(self, row: dict[str, Any]) -> str:
        return self.context(row["context"]) + row["continuation"]

    def contexts(self, row: dict[str, Any]) -> list[str]:
        return [self.context(row["context"])]

    def continuations(self, row: dict[str, Any]) -> list[str]:
        return [row["continuation"]]

    def answers(self, row: dict[str, Any]) -> list[str]:
        del row
        return []


class _MultipleChoice(_Layout):
    def solved(self, row: dict[str, Any]) -> str:
        return self.context(row["query"]) + row["choices"][row["gold"]]

    def contexts(self, row: dict[str, Any]) -> list[str]:
        return [self.context(row["query"])]

    def continuations(self, row: dict[str, Any]) -> list[str]:
        return list(row["choices"])


class _Schema(_Layout):
    def solved(self, row: dict[str, Any]) -> str:
        return self.context(row["context_options"][row["gold"]]) + row["continuation"]

    def contexts(self, row: dict[str, Any]) -> list[str]:
        return [self.context(option) for option in row["context_options"]]


class _Generation(_Layout):
    def solved(self, row: dict[str, Any]) -> str:
        return self.context(row["context"]) + self.target(row)

    def target(self, row: dict[str, Any]) -> str:
        """The answer as the model should write it: after its chain of thought when the rows have one."""
        if "chain_of_thought" in row:
            return f"{row['chain_of_thought']}{self.task.cot_delimiter}{row['answer']}"
        return row["answer"]

    def continuations(self, row: dict[str, Any]) -> list[str]:
        del row
        return []

    def answers(self, row: dict[str, Any]) -> list[str]:
        return list(dict.fromkeys([row["answer"], *row.get("aliases", [])]))


_LAYOUTS: dict[str, type[_Layout]] = {
    "language_modeling": _Layout,
    "multiple_choice": _MultipleChoice,
    "schema": _Schema,
    "generation_task_with_answers": _Generation,
}


def max_answer_text(task: ICLTaskConfig, row: dict[str, Any]) -> list[str]:
    """Every text a generation row may be answered with, as the model writes it (for max_new_tokens)."""
    layout = _Generation(task)
    return [layout.target({**row, "answer": answer}) for answer in layout.answers(row)]
