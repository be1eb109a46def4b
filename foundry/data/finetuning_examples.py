"""Finetuning examples: rows → token turns → (input_ids, labels), with truncation and the counts of what was dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundry.batches import IGNORE_INDEX
from foundry.data.chat import RenderChat, RowFormatError, text_turns
from foundry.data.config import Truncation

TokenTurn = tuple[list[int], list[int]]  # (prompt ids, response ids)


@dataclass
class FinetuningCounts:
    """What happened to the rows, logged once when the loader is built."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0  # kept, cut to max_seq_len by the truncation policy
    dropped_empty: int = 0  # an empty prompt or response
    dropped_too_long: int = 0  # longer than max_seq_len with truncation: drop
    dropped_no_targets: int = 0  # nothing left to train on after truncation (e.g. the prompt alone fills it)

    def __str__(self) -> str:
        return ", ".join(f"{field.name} {getattr(self, field.name)}" for field in dataclasses.fields(self))


@dataclass
class LabelPolicy:
    """Which tokens are trained on (LLM Foundry's target_prompts / target_responses)."""

    target_prompts: str
    target_responses: str

    def prompt_labels(self, prompt: list[int]) -> list[int]:
        if self.target_prompts == "all":
            return prompt
        if self.target_prompts.startswith("length>="):
            return prompt if len(prompt) >= int(self.target_prompts.removeprefix("length>=")) else _ignored(prompt)
        return _ignored(prompt)

    def response_labels(self, response: list[int], is_last_turn: bool) -> list[int]:
        return response if self.target_responses == "all" or is_last_turn else _ignored(response)


def _ignored(tokens: list[int]) -> list[int]:
    return [IGNORE_INDEX] * len(tokens)


def build_example(
    turns: list[TokenTurn], policy: LabelPolicy, max_seq_len: int, truncation: Truncation, counts: FinetuningCounts
) -> tuple[np.ndarray, np.ndarray] | None:
    """Stitch turns into (input_ids, labels), truncate, and count; None for a dropped example.

    The first label is always -100: nothing in the example predicts its first token, so packed
    examples never learn to predict across a boundary.
    """
    if not turns or any(not prompt or not response for prompt, response in turns):
        counts.dropped_empty += 1
        return None
    input_ids: list[int] = []
    labels: list[int] = []
    for index, (prompt, response) in enumerate(turns):
        input_ids += prompt + response
        labels += policy.prompt_labels(prompt) + policy.response_labels(response, index == len(turns) - 1)
    is_too_long = len(input_ids) > max_seq_len
    if is_too_long:
        if truncation == "drop":
            counts.dropped_too_long += 1
            return None
        keep = slice(None, max_seq_len) if truncation == "keep_start" else slice(-max_seq_len, None)
        input_ids, labels = input_ids[keep], labels[keep]
    labels[0] = IGNORE_INDEX
    if all(label == IGNORE_INDEX for label in labels):
        counts.dropped_no_targets += 1
        return None
    counts.kept += 1
    counts.truncated += is_too_long
    return np.asarray(input_ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def token_turns(
    row: Any, tokenizer: Any, render: RenderChat, eos_token_id: int | None, token_encoding_type: str = "int64"
) -> list[TokenTurn]:
    """A row's (prompt ids, response ids) turns; the last response ends with eos."""
    if isinstance(row, Mapping) and "turns" in row:  # pre-tokenized (LLM Foundry's MDS format)
        try:
            turns = [
                (_token_list(turn["input_ids"], token_encoding_type), _token_list(turn["labels"], token_encoding_type))
                for turn in row["turns"]
            ]
        except (KeyError, TypeError, ValueError) as error:
            raise RowFormatError(f"'turns' must be a list of {{input_ids, labels}} token lists ({error!r})") from None
    else:
        texts, is_chat = text_turns(row, render)
        turns = [
            (
                tokenizer(prompt, add_special_tokens=not is_chat)["input_ids"],  # plain prompts get BOS if any
                tokenizer(response, add_special_tokens=False)["input_ids"] if response.strip() else [],
            )
            for prompt, response in texts
        ]
    last_response = turns[-1][1] if turns else []
    if last_response and eos_token_id is not None and last_response[-1] != eos_token_id:
        turns[-1] = (turns[-1][0], [*last_response, eos_token_id])
    return turns


def _token_list(value: Any, token_encoding_type: str) -> list[int]:
    if isinstance(value, bytes):
        value = np.frombuffer(value, dtype=np.dtype(token_encoding_type))
    return [int(token) for token in value]
