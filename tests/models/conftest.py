"""Tiny models for CPU tests: MPT (d_model 32, 2 layers, vocab 64, seq 16, fp32) and a saved HF Llama."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.models import MPTCausalLM

TINY_MPT: dict[str, Any] = {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 16}
VOCAB, SEQ = 64, 16


def tiny_mpt_keys(**overrides: Any) -> dict[str, Any]:
    """TINY_MPT with ``overrides``; ``attn_config`` overrides merge into the torch-attention default."""
    attn_config = {"attn_impl": "torch", **overrides.pop("attn_config", {})}
    return {**TINY_MPT, "attn_config": attn_config, **overrides}


@pytest.fixture
def mpt_keys() -> Callable[..., dict[str, Any]]:
    """``tiny_mpt_keys``: a tiny model section as a YAML would give it."""
    return tiny_mpt_keys


@pytest.fixture
def make_mpt() -> Callable[..., MPTCausalLM]:
    """Build a tiny MPT; a fixed seed so two calls with the same keys give the same weights."""

    def make(seed: int = 0, **overrides: Any) -> MPTCausalLM:
        torch.manual_seed(seed)
        return MPTCausalLM(**tiny_mpt_keys(**overrides))

    return make


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random LlamaForCausalLM: 32 wide, 2 layers, 4 query / 2 key-value heads, vocab 128, untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    out_dir = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir
