"""Document masking: examples packed into one row give the same loss as each example alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry.batches import IGNORE_INDEX
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.hf import refuse_packed_examples

SEQ = 16
LENGTHS = (5, 7)  # two examples packed into one row of SEQ tokens, the rest padding

ROPE: dict[str, Any] = {"learned_pos_emb": False, "attn_config": {"rope": True, "attn_uses_sequence_id": True}}
ALIBI: dict[str, Any] = {"learned_pos_emb": False, "attn_config": {"alibi": True, "attn_uses_sequence_id": True}}
MODELS: dict[str, tuple[type, dict[str, Any]]] = {
    "mpt-rope-sdpa": (MPTCausalLM, {**TINY_MPT, **ROPE}),
    "mpt-alibi-sdpa": (MPTCausalLM, {**TINY_MPT, **ALIBI}),
    "mpt-learned-pos-torch": (
        MPTCausalLM, {**TINY_MPT, "attn_config": {"attn_impl": "torch", "attn_uses_sequence_id": True}},
    ),
    "llama-gqa-sdpa": (LlamaCausalLM, {**TINY_LLAMA, "attn_uses_sequence_id": True}),
    "llama-gqa-torch": (LlamaCausalLM, {**TINY_LLAMA, "attn_impl": "torch", "attn_uses_sequence_id": True}),
}  # fmt: skip


def build(name: str, **changes: Any) -> torch.nn.Module:
    model_class, keys = MODELS[name]
    torch.manual_seed(0)
    return model_class(**{**keys, **changes}).eval()


def examples(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for length in LENGTHS]


def unpacked_batch(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """One example, right-padded to SEQ."""
    input_ids = torch.zeros(1, SEQ, dtype=torch.long)
    input_ids[0, : len(tokens)] = tokens
    attention_mask = (torch.arange(SEQ) < len(tokens)).long()[None]
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch(parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """All examples in one row, with the sequence_id and restarting position_ids the finetuning loader emits."""
    used = sum(len(part) for part in parts)
    input_ids = torch.cat([*parts, torch.zeros(SEQ - used, dtype=torch.long)])[None]
    sequence_id = torch.cat([torch.full((len(part),), index) for index, part in enumerate(parts)])
    sequence_id = torch.cat([sequence_id, torch.full((SEQ - used,), -1)])[None]
    position_ids = torch.cat([torch.arange(len(part)) for part in parts] + [torch.zeros(SEQ - used, dtype=torch.long)])
    return {
        "input_ids": input_ids,
        "attention_mask": (sequence_id >= 0).long(),
        "sequence_id": sequence_id,
        "position_ids": position_ids[None],
    }


def per_example_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The model's own loss, with labels kept only on example k (its first token is never a target)."""
    logits = model(batch)
    losses = []
    for example in range(len(LENGTHS)):
        in_example = batch["sequence_id"] == example
        first = in_example & ~torch.roll(in_example, 1, dims=1)
        labels = batch["input_ids"].masked_fill(~in_example | first, IGNORE_INDEX)
        losses.append(model.loss(logits, {**batch, "labels": labels}))
    return losses


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_examples_give_the_same_loss_as_unpacked(name: str) -> None:
    model = build(name)
    parts = examples(model.config.vocab_size)
    with torch.no_grad():
        packed = per_example_losses(model, packed_batch(parts))
        alone = [model.loss(model(batch), batch) for batch in map(unpacked_batch, parts)]
    for packed_loss, alone_loss in zip(packed, alone, strict=True):
        torch.testing.assert_close(packed_loss, alone_loss, rtol=0, atol=1e-5)


def test_without_sequence_id_masking_packed_examples_see_each_other() -> None:
    model = build("mpt-rope-sdpa", attn_config={"rope": True, "attn_uses_sequence_id": False})
    assert not model.config.attn_config.attn_uses_sequence_id
    parts = examples(model.config.vocab_size)
    with torch.no_grad():
        second_packed = per_example_losses(model, packed_batch(parts))[1]
        second_alone = model.loss(model(unpacked_batch(parts[1])), unpacked_batch(parts[1]))
    assert abs(second_packed.item() - second_alone.item()) > 1e-4


def test_position_ids_restart_learned_positions() -> None:
    """RoPE and ALiBi are relative (a shift changes nothing); learned embeddings see the restart."""
    model = build("mpt-learned-pos-torch")
    parts = examples(model.config.vocab_size)
    batch = packed_batch(parts)
    with torch.no_grad():
        restarted = model(batch)
        counted_on = model({**batch, "position_ids": torch.arange(SEQ)[None]})
    first, second = slice(0, LENGTHS[0]), slice(LENGTHS[0], sum(LENGTHS))
    torch.testing.assert_close(restarted[:, first], counted_on[:, first])
    assert not torch.allclose(restarted[:, second], counted_on[:, second], atol=1e-4)


@pytest.mark.parametrize("attn_impl", ["flash2", "cudnn"])
def test_pinned_kernels_refuse_sequence_id_masking(attn_impl: str) -> None:
    with pytest.raises(ConfigError, match=rf"'model\.attn_config\.attn_uses_sequence_id'.*{attn_impl}.*'sdpa'"):
        MPTCausalLM(**TINY_MPT, attn_config={"attn_impl": attn_impl, "attn_uses_sequence_id": True})


def test_hf_causal_lm_refuses_rows_that_pack_several_examples() -> None:
    one_example_per_row = {"sequence_id": torch.tensor([[0, 0, -1], [0, 0, 0]])}
    refuse_packed_examples(one_example_per_row)  # unpacked finetuning batches are fine
    with pytest.raises(ConfigError, match=r"hf_causal_lm cannot mask attention.*packing_ratio"):
        refuse_packed_examples({"sequence_id": torch.tensor([[0, 0, 1]])})
