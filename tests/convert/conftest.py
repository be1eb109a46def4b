"""Tiny foundry models, a tiny tokenizer and a logits comparison for the Hugging Face conversion tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry.data import builtin_corpus_documents, train_bpe_tokenizer
from foundry.models import LlamaCausalLM, MPTCausalLM

VOCAB, SEQ = 96, 32
# The MPT settings transformers' MptForCausalLM can express.
HF_MPT: dict[str, Any] = {**TINY_MPT, "no_bias": True, "learned_pos_emb": False, "attn_config": {"alibi": True}}


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaCausalLM:
    torch.manual_seed(seed)
    return LlamaCausalLM(**{**TINY_LLAMA, **overrides}).eval()


def tiny_mpt(seed: int = 0, **overrides: Any) -> MPTCausalLM:
    attn_config = {**HF_MPT["attn_config"], **overrides.pop("attn_config", {})}
    torch.manual_seed(seed)
    return MPTCausalLM(**{**HF_MPT, **overrides, "attn_config": attn_config}).eval()


@torch.no_grad()
def max_logit_difference(model: torch.nn.Module, hf_model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """Largest |foundry logit - transformers logit| over a batch, both in fp32."""
    ours = model({"input_ids": input_ids})
    theirs = hf_model(input_ids=input_ids).logits
    return (ours - theirs).abs().max().item()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token byte-level BPE tokenizer (byte-level BPE needs more than 256)."""
    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=out_dir)
    return out_dir


@pytest.fixture
def make_llama() -> Callable[..., LlamaCausalLM]:
    """``tiny_llama``: TINY_LLAMA (GQA, 64 wide, 2 layers, vocab 96) with overrides, in eval mode."""
    return tiny_llama


@pytest.fixture
def make_mpt() -> Callable[..., MPTCausalLM]:
    """``tiny_mpt``: an MPT that MptForCausalLM can express (ALiBi, no biases), with overrides."""
    return tiny_mpt


@pytest.fixture
def logit_gap() -> Callable[[torch.nn.Module, torch.nn.Module, torch.Tensor], float]:
    return max_logit_difference


@pytest.fixture
def input_ids() -> torch.Tensor:
    """(2, 32) random token ids below 96."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
