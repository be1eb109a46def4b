"""FLOPs by LLM Foundry's MFU formula, against a hand count for the tiny model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from foundry.models import MPTCausalLM

# d_model 32, 2 layers, vocab 64, max_seq_len 16, expansion 4, biases and LayerNorm bias on:
WTE, WPE = 64 * 32, 16 * 32
BLOCK = (
    2 * 32  # norm_1
    + (32 * 96 + 96)  # Wqkv
    + (32 * 32 + 32)  # out_proj
    + 2 * 32  # norm_2
    + (32 * 128 + 128)  # up_proj
    + (128 * 32 + 32)  # down_proj
)
NORM_F = 2 * 32
TIED_PARAMS = WTE + WPE + 2 * BLOCK + NORM_F  # 28,032


def test_num_params_counts_tied_embeddings_once(make_mpt: Callable[..., MPTCausalLM]) -> None:
    assert make_mpt().num_params == TIED_PARAMS == 28_032


def test_flops_per_batch_matches_the_hand_count(make_mpt: Callable[..., MPTCausalLM]) -> None:
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    params_flops = 2 * TIED_PARAMS * 16
    attention_flops = 2 * 2 * 2 * 32 * 16**2  # n_layers * 2 matmuls * 2 flops * d_model * seq^2
    assert make_mpt().flops_per_batch(batch) == 3 * 2 * (params_flops + attention_flops) == 5_775_360


def test_untied_lm_head_counts_but_the_embedding_lookup_does_not(make_mpt: Callable[..., MPTCausalLM]) -> None:
    untied = make_mpt(tie_word_embeddings=False)
    assert untied.num_params == TIED_PARAMS + 64 * 32
    assert untied.n_active_params == TIED_PARAMS  # + lm_head - wte


def test_flops_per_token_is_flops_per_batch_over_tokens(make_mpt: Callable[..., MPTCausalLM]) -> None:
    model = make_mpt()
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert model.flops_per_token(16) * 3 * 16 == model.flops_per_batch(batch)


def test_a_preference_batch_counts_its_chosen_and_rejected_rows(make_mpt: Callable[..., MPTCausalLM]) -> None:
    """(pairs, 2, seq): both rows of a pair run forward and backward through the policy (the DPO step's MFU)."""
    model = make_mpt()
    pairs = {"input_ids": torch.zeros(3, 2, 16, dtype=torch.long)}
    assert model.flops_per_batch(pairs) == model.flops_per_batch({"input_ids": torch.zeros(6, 16, dtype=torch.long)})


def test_attention_is_counted_over_the_width_of_q(make_mpt: Callable[..., MPTCausalLM]) -> None:
    """Heads of their own width (attn_config.head_dim 16: 4 heads, q 64 wide over d_model 32) attend over 64."""
    wide = make_mpt(attn_config={"head_dim": 16})
    assert wide.transformer.blocks[0].attn.out_proj.in_features == wide.config.q_dim == 64
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    attention_flops = 2 * 2 * 2 * 64 * 16**2
    assert wide.flops_per_batch(batch) == 3 * 2 * (2 * wide.n_active_params * 16 + attention_flops)
