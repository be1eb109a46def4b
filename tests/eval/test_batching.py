"""Token ids of prompts: special tokens where LLM Foundry puts them."""

from __future__ import annotations

from helpers import ByteTokenizer

from foundry.eval.batching import tokenize_examples
from foundry.eval.prompts import PromptedExample

BOS = 300


class BosByteTokenizer(ByteTokenizer):
    """Bytes, with BOS first when special tokens are asked for (as Llama's tokenizers do)."""

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        ids = super().__call__(text)["input_ids"]
        if add_special_tokens:
            ids = [[BOS, *item] for item in ids] if isinstance(text, list) else [BOS, *ids]
        return {"input_ids": ids}


def test_zero_shot_prompt_starts_with_bos_when_the_tokenizer_adds_one() -> None:
    prompt = PromptedExample(preamble="", contexts=["Hi"], continuations=[" x"])
    (example,) = tokenize_examples([prompt], BosByteTokenizer(), max_seq_len=32)
    assert example.requests == [([BOS, *b"Hi"], list(b" x"))]


def test_few_shot_prompt_has_one_bos_before_the_preamble_and_none_later() -> None:
    prompt = PromptedExample(preamble="A b", contexts=["\nHi"], continuations=[" x"])
    (example,) = tokenize_examples([prompt], BosByteTokenizer(), max_seq_len=32)
    assert example.requests == [([BOS, *b"A b", *b"\nHi"], list(b" x"))]


def test_tokenizer_without_bos_adds_nothing_to_a_zero_shot_prompt() -> None:
    prompt = PromptedExample(preamble="", contexts=["Hi"], continuations=[" x"])
    (example,) = tokenize_examples([prompt], ByteTokenizer(), max_seq_len=32)
    assert example.requests == [(list(b"Hi"), list(b" x"))]
