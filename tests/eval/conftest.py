"""A byte tokenizer, models rigged to like or dislike given tokens, and tiny jsonl task files for ICL tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import BYTE_EOS as EOS
from helpers import ByteTokenizer

from foundry.models.base import CausalLM


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


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token byte-level BPE tokenizer (a real transformers tokenizer for end-to-end runs)."""
    from foundry.data import builtin_corpus_documents, train_bpe_tokenizer

    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=out_dir)
    return out_dir


def save_tiny_mpt(save_folder: Path, tokenizer_dir: Path, **model_keys: Any) -> Path:
    """A weights-only checkpoint of a random tiny MPT (``model_keys`` on top) that names its tokenizer."""
    from foundry.convert.checkpoint_io import save_weights_checkpoint
    from foundry.models.build import build_model

    section = {"name": "mpt_causal_lm", "d_model": 32, "n_heads": 2, "n_layers": 2, "vocab_size": 320, **model_keys}
    torch.manual_seed(0)
    config = {"model": section, "tokenizer": {"name": str(tokenizer_dir)}}
    save_weights_checkpoint(build_model(section), save_folder, config, overwrite=True)
    return save_folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer_dir: Path) -> Path:
    """A save_folder holding one weights-only checkpoint of a random tiny MPT that names its tokenizer."""
    return save_tiny_mpt(tmp_path_factory.mktemp("run") / "checkpoints", bpe_tokenizer_dir, max_seq_len=256)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer_dir: Path) -> Path:
    """A random tiny MPT exported with ``foundry convert to-hf``: an ``MptForCausalLM`` directory (max_seq_len 64)."""
    from foundry.cli import main

    save_folder = save_tiny_mpt(
        tmp_path_factory.mktemp("hf-run") / "checkpoints",
        bpe_tokenizer_dir,
        max_seq_len=64,
        attn_config={"alibi": True},  # the MPT settings transformers' MptForCausalLM has
        learned_pos_emb=False,
        no_bias=True,
    )
    out_dir = save_folder.parent / "hf"
    assert main(["convert", "to-hf", str(save_folder), str(out_dir)]) == 0
    return out_dir
