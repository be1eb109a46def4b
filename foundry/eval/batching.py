"""Prompts → token requests → padded batches: sorted by length, whole examples per batch, little padding.

A request is one (context, continuation) pair to score, or one prompt to generate from. The choices
of a multiple-choice question (the contexts of a schema row) always share a batch, so each example
is scored where it is counted. Batches are right-padded: with causal attention, real tokens never
see the padding, so no attention mask is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from foundry.errors import DataError
from foundry.eval.prompts import PromptedExample


@dataclasses.dataclass
class TokenizedExample:
    """An example's requests as token ids; ``requests[i] = (context_ids, continuation_ids)``."""

    requests: list[tuple[list[int], list[int]]]
    gold: int | None = None
    answers: list[str] = dataclasses.field(default_factory=list)

    @property
    def longest(self) -> int:
        return max(len(context) + len(continuation) for context, continuation in self.requests)


@dataclasses.dataclass
class Batch:
    """Rows of several examples. Row ``r`` holds ``input_ids[r, :lengths[r]]``; its continuation starts at
    ``continuation_starts[r]`` (== lengths[r] for generation prompts)."""

    input_ids: torch.Tensor  # (rows, longest row)
    lengths: torch.Tensor  # (rows,)
    continuation_starts: torch.Tensor  # (rows,)
    example_ids: list[int]  # indices into the task's examples, in row order (an example's rows are adjacent)
    rows_per_example: list[int]


def needs_prefix_space(tokenizer: Any) -> bool:
    """GPT-2 style BPE encodes ' a' as one token: continuations then need the space that precedes them in text."""
    return len(tokenizer(" a", add_special_tokens=False)["input_ids"]) == 1


def tokenize_examples(
    prompts: Sequence[PromptedExample], tokenizer: Any, max_seq_len: int, reserve_tokens: int = 0, where: str = ""
) -> list[TokenizedExample]:
    """Token ids of every request, contexts trimmed from the left to fit ``max_seq_len``.

    Preamble, context and continuation are tokenized separately (LLM Foundry's convention), so a
    continuation's tokens do not depend on the text before it. The preamble, even an empty one, is
    tokenized with the tokenizer's special tokens, so every prompt starts with BOS when the tokenizer
    adds one (a trailing EOS is dropped); contexts and continuations never get special tokens.
    ``reserve_tokens`` keeps room for generated tokens.
    """
    examples = []
    for prompt in prompts:
        preamble = _encode(tokenizer, prompt.preamble, special_tokens=True)
        contexts = [preamble + _encode(tokenizer, context) for context in prompt.contexts]
        continuations = [_encode(tokenizer, continuation) for continuation in prompt.continuations] or [[]]
        if len(contexts) == 1:
            pairs = [(contexts[0], continuation) for continuation in continuations]
        else:
            pairs = [(context, continuations[0]) for context in contexts]
        trimmed = [(_trim(ctx, len(cont) + reserve_tokens, max_seq_len, where), cont) for ctx, cont in pairs]
        examples.append(TokenizedExample(trimmed, prompt.gold, prompt.answers))
    return examples


def _encode(tokenizer: Any, text: str, special_tokens: bool = False) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])
    eos = tokenizer.eos_token_id
    if special_tokens and eos is not None and len(ids) > 1 and ids[-1] == eos:
        ids = ids[:-1]  # tokenizers that append eos would put it mid-prompt (a lone one stays, as in LLM Foundry)
    return ids


def _trim(context: list[int], reserved: int, max_seq_len: int, where: str) -> list[int]:
    room = max_seq_len - reserved
    if room < 1:
        raise DataError(
            f"{where}: a continuation (or answer) of {reserved} tokens does not fit in the ICL sequence length "
            f"{max_seq_len}. Raise icl_seq_len (or the task's max_seq_len)."
        )
    return context[-room:]


def make_batches(examples: Sequence[TokenizedExample], rows_per_batch: int, pad_token_id: int) -> list[Batch]:
    """Examples longest first, packed whole into batches of at most ``rows_per_batch`` rows
    (an example with more requests than that gets a batch of its own)."""
    order = sorted(range(len(examples)), key=lambda index: -examples[index].longest)
    batches, current, rows = [], [], 0
    for index in order:
        size = len(examples[index].requests)
        if current and rows + size > rows_per_batch:
            batches.append(_collate(examples, current, pad_token_id))
            current, rows = [], 0
        current.append(index)
        rows += size
    if current:
        batches.append(_collate(examples, current, pad_token_id))
    return batches


def _collate(examples: Sequence[TokenizedExample], indices: list[int], pad_token_id: int) -> Batch:
    rows = [context + continuation for index in indices for context, continuation in examples[index].requests]
    starts = [len(context) for index in indices for context, _ in examples[index].requests]
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_token_id, dtype=torch.long)
    for row, tokens in enumerate(rows):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return Batch(
        input_ids=input_ids,
        lengths=torch.tensor([len(tokens) for tokens in rows]),
        continuation_starts=torch.tensor(starts),
        example_ids=list(indices),
        rows_per_example=[len(examples[index].requests) for index in indices],
    )
