"""The whole MPT: shapes, causality, padding, tying, scaling, and that it learns."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from foundry import registry
from foundry.errors import ConfigError
from foundry.models import MPTCausalLM

MakeMPT = Callable[..., MPTCausalLM]


def test_forward_returns_logits_per_position(make_mpt: MakeMPT, input_ids: torch.Tensor) -> None:
    assert make_mpt()({"input_ids": input_ids}).shape == (2, 16, 64)


@pytest.mark.parametrize("position", ["learned_pos_emb", "alibi", "rope"])
def test_future_tokens_do_not_change_earlier_logits(make_mpt: MakeMPT, input_ids: torch.Tensor, position: str) -> None:
    attn_config = {} if position == "learned_pos_emb" else {position: True, "attn_impl": "sdpa"}
    model = make_mpt(attn_config=attn_config).eval()
    changed = input_ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    before, after = model({"input_ids": input_ids}), model({"input_ids": changed})
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("attn_impl", ["torch", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_token_logits_as_without_it(
    make_mpt: MakeMPT, input_ids: torch.Tensor, attn_impl: str, side: str
) -> None:
    model = make_mpt(attn_config={"attn_impl": attn_impl}).eval()
    real = input_ids[:1, :12]
    pads = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pads, real] if side == "left" else [real, pads], dim=1)
    mask = torch.cat([pads, torch.ones_like(real)] if side == "left" else [torch.ones_like(real), pads], dim=1)
    logits = model({"input_ids": padded, "attention_mask": mask})
    torch.testing.assert_close(logits[mask.bool()], model({"input_ids": real})[0], atol=1e-5, rtol=1e-5)


def test_sdpa_and_torch_models_agree(make_mpt: MakeMPT, input_ids: torch.Tensor) -> None:
    torch_model = make_mpt(attn_config={"attn_impl": "torch", "alibi": True})
    sdpa_model = make_mpt(attn_config={"attn_impl": "sdpa", "alibi": True})
    sdpa_model.load_state_dict(torch_model.state_dict())
    batch = {"input_ids": input_ids}
    torch.testing.assert_close(sdpa_model(batch), torch_model(batch), atol=1e-5, rtol=1e-5)


def test_tied_output_projection_is_the_token_embedding(make_mpt: MakeMPT, input_ids: torch.Tensor) -> None:
    model = make_mpt()
    assert model.lm_head is None
    assert model.output_weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    batch = {"input_ids": input_ids[:, :4] % 8}  # tokens 0..7 only
    model.loss(model(batch), batch).backward()
    # rows of tokens never fed in get gradient only through the output projection
    assert model.transformer.wte.weight.grad[8:].abs().sum() > 0


def test_untied_model_has_its_own_lm_head(make_mpt: MakeMPT) -> None:
    tied, untied = make_mpt(), make_mpt(tie_word_embeddings=False)
    assert untied.output_weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    assert untied.num_params == tied.num_params + 64 * 32


def test_logit_scale_multiplies_the_logits(make_mpt: MakeMPT, input_ids: torch.Tensor) -> None:
    plain, scaled = make_mpt(), make_mpt(logit_scale=0.25)
    scaled.load_state_dict(plain.state_dict())
    batch = {"input_ids": input_ids}
    torch.testing.assert_close(scaled(batch), 0.25 * plain(batch))


def test_loss_decreases_on_a_repeated_batch(make_mpt: MakeMPT, input_ids: torch.Tensor) -> None:
    model = make_mpt(attn_config={"attn_impl": "sdpa"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"input_ids": input_ids}
    losses = []
    for _ in range(20):
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_llm_foundry_mpt_small_cpu_section_builds() -> None:
    section = {  # scripts/train/yamls/pretrain/testing.yaml's model, minus name
        "d_model": 16,
        "n_heads": 4,
        "n_layers": 4,
        "expansion_ratio": 5,
        "max_seq_len": 128,
        "vocab_size": 50368,
        "attn_config": {"attn_impl": "torch"},
        "loss_fn": "torch_crossentropy",
        "init_device": "cpu",
    }
    model = registry.models.get("mpt_causal_lm")(**section)
    assert model({"input_ids": torch.zeros(1, 8, dtype=torch.long)}).shape == (1, 8, 50368)


def test_sequences_longer_than_max_seq_len_are_refused(make_mpt: MakeMPT) -> None:
    with pytest.raises(ConfigError, match="max_seq_len"):
        make_mpt()({"input_ids": torch.zeros(1, 17, dtype=torch.long)})
