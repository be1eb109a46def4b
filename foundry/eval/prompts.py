"""Prompt text of each ICL example, built as LLM Foundry 0.22 builds it, shots in the same order.

Every prompt is ``preamble + context + continuation``. The preamble is ``prompt_string`` followed by
``num_fewshot`` solved examples drawn (without the example itself) from the same rows; each piece
is preceded by ``example_delimiter`` when text comes before it::

    {prompt_string}{delim}{prelimiter}{ctx_1}{continuation_delimiter}{answer_1}{delim}...   <- preamble
    {delim}{prelimiter}{ctx}{continuation_delimiter}, right-stripped                      <- scored context
    {" " if the tokenizer needs it}{continuation}                                       <- scored continuation

Multiple choice has one context and a continuation per choice; generation has one context and no
continuation (the model writes it). Schema rows have a context per option and one continuation, in
LLM Foundry's own layout, which differs from the others in two places: a solved schema shot puts
``question_prelimiter`` before the example delimiter, and a scored 0-shot schema context has no
continuation delimiter (``{prelimiter}{option}``); with a preamble it is
``{prelimiter}{delim}{option}{continuation_delimiter.rstrip()}``.

The shots come in LLM Foundry's order, which is neither the sampled order nor sorted: it collects
the sampled row indices in a Python ``set`` and iterates that set (``fewshot_indices``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from foundry.eval.task_config import ICLTaskConfig


@dataclasses.dataclass
class PromptedExample:
    """One row as text. ``contexts`` × ``continuations`` are the scored pairs (one side has length 1)."""

    preamble: str  # prompt_string and the few-shot examples
    contexts: list[str]
    continuations: list[str]  # empty for generation
    gold: int | None = None  # index of the right pair (MC: the choice; schema: the context)
    answers: list[str] = dataclasses.field(default_factory=list)  # generation: answer and aliases


def fewshot_indices(num_rows: int, num_fewshot: int, example_index: int, rng: random.Random) -> list[int]:
    """``num_fewshot`` distinct row indices other than ``example_index``, in the order the shots appear.

    The draws are LLM Foundry's (``get_fewshot_sample_idxs``): ``rng.sample`` of the rows, and when the
    example itself was drawn, ``rng.choice`` until another row comes up. LLM Foundry keeps the indices
    in a ``set`` and writes the shots in the set's iteration order; that order depends on how the set
    was built (its table size and the insertions), so the same set is built here with the same
    operations in the same order and iterated as it is. For ints, CPython's set order is a function
    of those operations alone (an int hashes to itself; no hash randomisation).
    """
    num_fewshot = min(num_rows - 1, num_fewshot)
    chosen = set(rng.sample(range(num_rows), num_fewshot))
    if example_index in chosen:
        chosen.remove(example_index)
        if len(chosen) < num_rows - 1:
            replacement = rng.choice(range(num_rows))
            while replacement in chosen or replacement == example_index:
                replacement = rng.choice(range(num_rows))
            chosen.add(replacement)
    return list(chosen)  # the set's iteration order, deliberately


def build_prompts(
    task: ICLTaskConfig, rows: list[dict[str, Any]], num_fewshot: int, prefix_space: bool, limit: int | None = None
) -> list[PromptedExample]:
    """The rows of ``task`` as prompts with ``num_fewshot`` examples; the same seed gives the same shots.

    Args:
        prefix_space: whether continuations need a leading space to tokenize as they would mid-text
            (GPT-2 style BPE tokenizers do; SentencePiece ones do not).
        limit: prompt only the first ``limit`` rows (shots are still drawn from all rows, with the
            same random draws, so these prompts are exactly the first ones of a full run).
    """
    layout = _LAYOUTS[task.icl_task_type](task, rows)
    rng = random.Random(task.fewshot_random_seed)
    prompts = []
    for index, row in enumerate(rows[:limit]):
        preamble = task.prompt_string
        if num_fewshot > 0:
            for shot in fewshot_indices(len(rows), num_fewshot, index, rng):
                preamble += layout.solved(rows[shot], follows_text=bool(preamble))
        contexts = layout.contexts(row, follows_text=bool(preamble))
        continuations = [_with_prefix_space(text, prefix_space) for text in layout.continuations(row)]
        prompts.append(PromptedExample(preamble, contexts, continuations, row.get("gold"), layout.answers(row)))
    return prompts


def _with_prefix_space(text: str, prefix_space: bool) -> str:
    return f" {text}" if prefix_space and not text.startswith(" ") else text


class _Layout:
    """How one task type writes a row: as a solved few-shot example, as contexts, as continuations."""

    def __init__(self, task: ICLTaskConfig, rows: list[dict[str, Any]]) -> None:
        self.task = task

    def context(self, text: str, follows_text: bool) -> str:
        delimiter = self.task.example_delimiter if follows_text else ""
        return f"{delimiter}{self.task.question_prelimiter}{text}{self.task.continuation_delimiter}"

    def solved(self, row: dict[str, Any], follows_text: bool) -> str:
        return self.context(row["context"], follows_text) + row["continuation"]

    def contexts(self, row: dict[str, Any], follows_text: bool) -> list[str]:
        return [self.context(row["context"], follows_text).rstrip()]

    def continuations(self, row: dict[str, Any]) -> list[str]:
        return [row["continuation"]]

    def answers(self, row: dict[str, Any]) -> list[str]:
        del row
        return []


class _MultipleChoice(_Layout):
    def solved(self, row: dict[str, Any], follows_text: bool) -> str:
        return self.context(row["query"], follows_text) + row["choices"][row["gold"]]

    def contexts(self, row: dict[str, Any], follows_text: bool) -> list[str]:
        return [self.context(row["query"], follows_text).rstrip()]

    def continuations(self, row: dict[str, Any]) -> list[str]:
        return list(row["choices"])


class _Schema(_Layout):
    def solved(self, row: dict[str, Any], follows_text: bool) -> str:
        delimiter = self.task.example_delimiter if follows_text else ""
        option = row["context_options"][row["gold"]]
        prelimiter, continuation_delimiter = self.task.question_prelimiter, self.task.continuation_delimiter
        return f"{prelimiter}{delimiter}{option}{continuation_delimiter}{row['continuation']}"

    def contexts(self, row: dict[str, Any], follows_text: bool) -> list[str]:
        prelimiter = self.task.question_prelimiter
        if not follows_text:
            return [f"{prelimiter}{option}" for option in row["context_options"]]
        delimiters = (self.task.example_delimiter, self.task.continuation_delimiter.rstrip())
        return [f"{prelimiter}{delimiters[0]}{option}{delimiters[1]}" for option in row["context_options"]]


class _Generation(_Layout):
    def __init__(self, task: ICLTaskConfig, rows: list[dict[str, Any]]) -> None:
        super().__init__(task, rows)
        # As LLM Foundry: when any row has a chain of thought, every answer is written after one ('' if absent).
        self.has_chain_of_thought = any("chain_of_thought" in row for row in rows)

    def solved(self, row: dict[str, Any], follows_text: bool) -> str:
        return self.context(row["context"], follows_text) + self.target(row, row["answer"])

    def target(self, row: dict[str, Any], answer: str) -> str:
        """``answer`` as the model should write it: after the row's chain of thought when the task has them."""
        if self.has_chain_of_thought:
            return f"{row.get('chain_of_thought', '')}{self.task.cot_delimiter}{answer}"
        return answer

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


def answer_texts(task: ICLTaskConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Every text a generation row may be answered with, as the model writes it (for max_new_tokens)."""
    layout = _Generation(task, rows)
    return [layout.target(row, answer) for row in rows for answer in layout.answers(row)]
