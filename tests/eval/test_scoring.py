"""Greedy generation: the KV-cached loop writes exactly the tokens of the loop that re-runs the prefix."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers import TINY_DECODERS, IdsTokenizer, build_tiny_decoder

from foundry.eval.scoring import greedy_generate

PROMPTS = [[5, 17, 3, 9, 40, 2, 11], [8, 1], [60, 61, 62, 63], [33]]  # different lengths: the batch is padded
MAX_NEW_TOKENS = 6


def generate(model: torch.nn.Module, use_cache: bool, tokenizer: IdsTokenizer, stops: Sequence[str] = ()) -> list:
    model.config.use_cache = use_cache
    return greedy_generate(model, PROMPTS, MAX_NEW_TOKENS, tokenizer, stops)


@pytest.mark.parametrize("variant", list(TINY_DECODERS))
def test_cached_generation_writes_the_tokens_of_the_uncached_loop(variant) -> None:
    model = build_tiny_decoder(variant)
    tokenizer = IdsTokenizer(eos_token_id=-1)  # no eos: every row runs MAX_NEW_TOKENS steps
    assert generate(model, True, tokenizer) == generate(model, False, tokenizer)


def test_cached_generation_stops_each_row_at_eos_as_the_uncached_loop_does() -> None:
    model = build_tiny_decoder("llama_gqa")
    rows = [text.split() for text in generate(model, False, IdsTokenizer(eos_token_id=-1))]
    eos = next(int(row[2]) for row in rows if row[2] not in row[:2])  # some row's third token is its first eos
    tokenizer = IdsTokenizer(eos_token_id=eos)
    expected = generate(model, False, tokenizer)
    assert len({len(text.split()) for text in expected}) > 1  # rows stop at different steps
    assert generate(model, True, tokenizer) == expected


def test_cached_generation_stops_at_a_stop_string_as_the_uncached_loop_does() -> None:
    model = build_tiny_decoder("mpt_alibi")
    tokenizer = IdsTokenizer(eos_token_id=-1)
    stop = " " + generate(model, False, tokenizer)[1].split()[1]  # row 1's second token ends it
    expected = generate(model, False, tokenizer, [stop])
    assert expected[1].endswith(stop) and len(expected[1].split()) < MAX_NEW_TOKENS
    assert generate(model, True, tokenizer, [stop]) == expected
