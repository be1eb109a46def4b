"""A byte tokenizer, models rigged to like or dislike given tokens, and tiny jsonl task files for ICL tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.models.base import CausalLM

EOS = 256


class ByteTokenizer:
    """One token per UTF-8 byte plus eos (id 256): predictable ids for hand-checked tests."""

    eos_token_id = EOS
    pad_token_id = EOS
    eos_token = pad_token = "<eos>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        del add_special_tokens
        return {"input_ids": list(text.encode())}

    def __len__(self) -> int:
        return EOS + 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < EOS).decode(errors="replace")


class RiggedLM(CausalLM):
    """Whatever the input, predicts ``favourite`` bytes with high probability (and eos lowest).

    ``bias[token]`` is added to uniform logits; a positive bias on the gold answer's letters makes the
    model prefer the gold continuation, a negative one makes it avoid it.
    """

    def __init__(self, bias: dict[int, float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(EOS + 1))
        with torch.no_grad():
            for token, value in bias.items():
                self.weight[token] = value

    def forward(self, batch: dict) -> torch.Tensor:
        input_ids = batch["input_ids"]
        return self.weight.expand(*input_ids.shape, EOS + 1).clone()  # (batch, seq, vocab)


class TriggeredLM(CausalLM):
    """Predicts the bytes of ``text`` strongly at every position after ``trigger`` appeared in the input."""

    def __init__(self, trigger: str, text: str, strength: float = 5.0) -> None:
        super().__init__()
        self.trigger = ord(trigger)
        self.favourites = list(text.encode())
        self.strength = torch.nn.Parameter(torch.tensor(strength))

    def forward(self, batch: dict) -> torch.Tensor:
        input_ids = batch["input_ids"]
        seen = ((input_ids == self.trigger).cumsum(dim=1) > 0).float()  # (batch, seq)
        logits = torch.zeros(*input_ids.shape, EOS + 1)
        logits[..., self.favourites] = (self.strength * seen)[..., None]
        return logits


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def rigged_lm() -> Callable[..., RiggedLM]:
    """``rigged_lm(text, bias)``: a model whose every prediction favours (bias > 0) the bytes of ``text``."""

    def make(text: str, bias: float = 5.0) -> RiggedLM:
        return RiggedLM({byte: bias for byte in text.encode()})

    return make


@pytest.fixture
def triggered_lm() -> type[TriggeredLM]:
    """``triggered_lm(trigger, text)``: a model whose continuations depend on its context."""
    return TriggeredLM


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[[str, list[Any]], Path]:
    """``write_jsonl(name, rows)``: rows (dicts, or raw strings written as-is) as a jsonl file."""

    def write(name: str, rows: list[Any]) -> Path:
        path = tmp_path / name
        path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
        return path

    return write
