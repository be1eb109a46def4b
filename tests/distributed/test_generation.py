"""KV-cached greedy generation on 2 FSDP gloo ranks, one finishing early: each rank gets its one-rank tokens."""

from __future__ import annotations

import torch
from helpers import IdsTokenizer

RANK_PROMPTS = [[[5, 17, 3, 9, 40, 2, 11]], [[8, 1], [60, 61, 62], [33, 4, 4, 4, 4]]]  # rank r's prompts
MAX_NEW_TOKENS = 6


def generate(prompts_of_ranks: list, eos: int, fsdp: bool) -> list[str]:
    """This rank's prompts, greedily continued by a tiny MPT (FSDP-sharded when ``fsdp``)."""
    from foundry import distributed
    from foundry.distributed.config import FSDPConfig
    from foundry.models import MPTCausalLM
    from foundry.models.generation import greedy_generate

    torch.manual_seed(0)
    model = MPTCausalLM(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=32).eval()
    if fsdp:
        distributed.parallelize(model, FSDPConfig(), torch.device("cpu"), "fp32")
    return greedy_generate(model, prompts_of_ranks[distributed.get_rank()], MAX_NEW_TOKENS, IdsTokenizer(eos))


def test_fsdp_ranks_that_stop_at_different_steps_generate_their_one_rank_tokens(ranks) -> None:
    rank_0_alone = generate(RANK_PROMPTS[:1], eos=-1, fsdp=False)  # in this process: one rank, no group
    eos = int(rank_0_alone[0].split()[1])  # rank 0's only row stops at its second token
    expected = [generate([prompts], eos, fsdp=False) for prompts in RANK_PROMPTS]
    assert len(expected[0][0].split()) == 2 < max(len(text.split()) for text in expected[1])
    assert ranks.run(2, generate, RANK_PROMPTS, eos, True) == expected
