"""The finetuning loader on 2 gloo ranks: each step's rows split between ranks, none twice."""

from __future__ import annotations

import json
from pathlib import Path

from foundry.data import build_finetuning_dataloader, builtin_corpus_documents, load_tokenizer, train_bpe_tokenizer

GLOBAL_BATCH = 4


def rows_per_batch(data: str, tokenizer_dir: str, device_batch_size: int) -> list[list[list[int]]]:
    """The loader's batches of this rank for epoch 1, as rows of example indices."""
    dataset = {"hf_name": data, "max_seq_len": 64, "packing_ratio": 2, "shuffle": True, "shuffle_seed": 5}
    loader = build_finetuning_dataloader(
        tokenizer=load_tokenizer(tokenizer_dir), device_batch_size=device_batch_size, dataset=dataset
    )
    return loader.epoch_batches(1)


def test_two_ranks_split_each_step_of_the_one_rank_epoch(ranks, tmp_path: Path) -> None:
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=280, out_dir=tmp_path / "tokenizer")
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"Q{index}:", "response": " yes" * (1 + index % 5)} for index in range(30)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    args = (str(data), str(tmp_path / "tokenizer"))
    rank0, rank1 = ranks.run(2, rows_per_batch, *args, GLOBAL_BATCH // 2)
    (one_rank,) = ranks.run(1, rows_per_batch, *args, GLOBAL_BATCH)
    assert len(rank0) == len(rank1) == len(one_rank)
    for first_half, second_half, whole in zip(rank0, rank1, one_rank, strict=True):
        assert first_half + second_half == whole
