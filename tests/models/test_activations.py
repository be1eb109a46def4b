"""The activation-memory estimate reads a block's widths from its config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from foundry.models import MPTCausalLM
from foundry.models.activations import BlockShape


def test_heads_of_their_own_width_widen_q_and_the_attention_output(make_mpt: Callable[..., MPTCausalLM]) -> None:
    """attn_config.head_dim 16 over 4 heads: q and the attention output are 64 wide, not d_model's 32."""
    keys: dict[str, Any] = {"init_device": "meta"}
    plain, wide = (
        BlockShape.of(make_mpt(**keys).config),
        BlockShape.of(make_mpt(attn_config={"head_dim": 16}, **keys).config),
    )
    assert (plain.q_dim, plain.kv_dim, wide.q_dim, wide.kv_dim) == (32, 32, 64, 64)
    # q, k, v and the attention output: 64 + 2 * 64 + 64 against 32 + 2 * 32 + 32
    assert wide.saved_elements_per_token() - plain.saved_elements_per_token() == 128
    assert wide.kept_attention_bytes_per_token(2) - plain.kept_attention_bytes_per_token(2) == 2 * 32
