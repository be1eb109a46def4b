"""The preference loader: pair layout, chat pairs, truncation, and the rows it refuses before training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry import registry
from foundry.batches import IGNORE_INDEX
from foundry.data.chat import render_plain_chat
from foundry.data.corpus import builtin_instruction_rows, builtin_preference_rows
from foundry.data.preference import build_preference_dataloader
from foundry.errors import ConfigError, DataError
from foundry.models.mpt import MPTCausalLM
from foundry.preference import PreferenceConfig, PreferenceObjective

SEQ = 32


def build(tokenizer: Any, tmp_path: Path, rows: list[Any], **dataset: Any) -> Any:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return build_preference_dataloader(
        tokenizer=tokenizer, device_batch_size=2, dataset={"hf_name": str(path), "max_seq_len": SEQ, **dataset}
    )


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_preference_is_registered_as_a_dataloader() -> None:
    assert registry.dataloaders.get("preference") is build_preference_dataloader


def test_each_pair_is_prompt_plus_chosen_then_prompt_plus_rejected_labelled_on_the_response(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    rows = [{"prompt": "The quick fox", "chosen": " jumps over", "rejected": " is not amused"}]
    batch = next(iter(build(tiny_tokenizer, tmp_path, rows)))
    prompt, eos = ids(tiny_tokenizer, "The quick fox"), [tiny_tokenizer.eos_token_id]
    chosen, rejected = ids(tiny_tokenizer, " jumps over") + eos, ids(tiny_tokenizer, " is not amused") + eos
    longest = len(prompt) + max(len(chosen), len(rejected))
    assert batch["input_ids"].shape == (1, 2, longest)
    for side, response in enumerate((chosen, rejected)):
        padding = longest - len(prompt) - len(response)
        assert batch["input_ids"][0, side, : len(prompt) + len(response)].tolist() == prompt + response
        assert batch["labels"][0, side].tolist() == [IGNORE_INDEX] * len(prompt) + response + [IGNORE_INDEX] * padding
        assert batch["attention_mask"][0, side].sum().item() == len(prompt) + len(response)


def test_chat_pairs_share_the_rendered_prompt_and_differ_in_the_last_reply(tmp_path: Path, tiny_tokenizer: Any) -> None:
    question = [{"role": "user", "content": "Which fox?"}]
    rows = [{
        "chosen": [*question, {"role": "assistant", "content": "The quick one."}],
        "rejected": [*question, {"role": "assistant", "content": "A lazy dog."}],
    }]  # fmt: skip
    batch = next(iter(build(tiny_tokenizer, tmp_path, rows, max_seq_len=128)))
    prompt = ids(tiny_tokenizer, render_plain_chat(question, True))
    chosen = [*ids(tiny_tokenizer, "The quick one.\n"), tiny_tokenizer.eos_token_id]
    assert batch["input_ids"][0, 0, : len(prompt) + len(chosen)].tolist() == prompt + chosen
    assert batch["input_ids"][0, 1, : len(prompt)].tolist() == prompt
    assert (batch["labels"][0, :, : len(prompt)] == IGNORE_INDEX).all()


def test_a_long_pair_keeps_its_prompt_and_cuts_each_response_at_max_seq_len(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    rows = [{"prompt": "Fox", "chosen": " jumps" * 40, "rejected": " no"}]
    batch = next(iter(build(tiny_tokenizer, tmp_path, rows)))
    assert batch["input_ids"].shape[-1] == SEQ
    assert batch["attention_mask"][0, 1].sum().item() < SEQ


@pytest.mark.parametrize("field", ["chosen", "rejected"])
def test_an_empty_response_is_refused_naming_its_field_and_row(tmp_path: Path, tiny_tokenizer: Any, field: str) -> None:
    rows = [{"prompt": "Fox", "chosen": " a", "rejected": " b"}, {"prompt": "Fox", "chosen": " a", "rejected": " b"}]
    rows[1][field] = ""
    with pytest.raises(DataError, match=rf"pairs.jsonl:2: '{field}' is empty"):
        build(tiny_tokenizer, tmp_path, rows)


def test_a_prompt_longer_than_max_seq_len_is_refused_saying_what_truncation_does(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    rows = [{"prompt": "The quick brown fox" * 20, "chosen": " a", "rejected": " b"}]
    with pytest.raises(DataError, match=r"'prompt' has \d+ tokens.*max_seq_len' is 32.*cuts each response"):
        build(tiny_tokenizer, tmp_path, rows)


def test_a_row_without_rejected_is_refused_listing_its_keys(tmp_path: Path, tiny_tokenizer: Any) -> None:
    with pytest.raises(DataError, match=r"needs 'chosen' and 'rejected'.*\['chosen', 'prompt'\]"):
        build(tiny_tokenizer, tmp_path, [{"prompt": "Fox", "chosen": " a"}])


def test_builtin_pairs_prefer_each_instructions_answer_to_its_words_reversed(tiny_tokenizer: Any) -> None:
    loader = build_preference_dataloader(
        tokenizer=tiny_tokenizer, device_batch_size=8, dataset={"builtin": True, "max_seq_len": 512}
    )
    rows = builtin_preference_rows()
    assert len(loader.pairs) == len(rows) == len(builtin_instruction_rows())
    assert rows[0]["rejected"].split() == rows[0]["chosen"].split()[::-1]


def packing_model(attn_uses_sequence_id: bool) -> MPTCausalLM:
    torch.manual_seed(0)
    return MPTCausalLM(
        d_model=16, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=320, no_bias=True, learned_pos_emb=False,
        attn_config={"alibi": True, "attn_uses_sequence_id": attn_uses_sequence_id},
    )  # fmt: skip


def pair_logps(model: MPTCausalLM, loader: Any) -> tuple[list[float], list[float]]:
    """Every pair's chosen and rejected log-probability over one epoch, each list sorted."""
    objective = PreferenceObjective(PreferenceConfig(loss_type="simpo"))
    objective.attach(model)
    chosen, rejected = [], []
    with torch.no_grad():
        for batch in loader:
            outputs = objective.forward(model, batch)
            real = outputs["tokens"].chunk(2)[0].flatten() > 0
            chosen += outputs["policy"].chunk(2)[0].flatten()[real].tolist()
            rejected += outputs["policy"].chunk(2)[1].flatten()[real].tolist()
    return sorted(chosen), sorted(rejected)


def test_packed_pairs_have_the_log_probabilities_of_the_pairs_unpacked(tmp_path: Path, tiny_tokenizer: Any) -> None:
    rows = [
        {"prompt": f"Q{i}: fox", "chosen": " quick" * (1 + i % 3), "rejected": " lazy" * (2 + i % 2)} for i in range(9)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    def loader(packing_ratio: float | None) -> Any:
        dataset = {"hf_name": str(path), "max_seq_len": 64, "packing_ratio": packing_ratio}
        return build_preference_dataloader(tokenizer=tiny_tokenizer, device_batch_size=2, dataset=dataset)

    packed = loader(3)
    assert len(packed.rows) < len(rows) and "sequence_id" in next(iter(packed))
    unpacked_chosen, unpacked_rejected = pair_logps(packing_model(True), loader(None))
    packed_chosen, packed_rejected = pair_logps(packing_model(True), packed)
    assert packed_chosen == pytest.approx(unpacked_chosen, rel=1e-6)
    assert packed_rejected == pytest.approx(unpacked_rejected, rel=1e-6)
    assert len(packed_chosen) == len(rows)


def test_packed_pairs_on_a_model_that_lets_them_attend_to_each_other_are_refused(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": "Q", "chosen": " a", "rejected": " b"}) + "\n" for _ in range(4)))
    dataset = {"hf_name": str(path), "max_seq_len": 64, "packing_ratio": 2}
    packed = build_preference_dataloader(tokenizer=tiny_tokenizer, device_batch_size=1, dataset=dataset)
    with pytest.raises(ConfigError, match=r"attn_uses_sequence_id: true"):
        pair_logps(packing_model(False), packed)
