from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest
from streaming import StreamingDataset

from foundry.data import convert as convert_module
from foundry.data import convert_to_mds, load_tokenizer, release_shared_memory
from foundry.data.convert import add_convert_arguments, read_documents, run_convert, split_documents
from foundry.errors import ConfigError, DataError
from tests.data.conftest import DOCUMENTS, write_documents


def read_column(split_dir: Path, column: str) -> list:
    """Every sample's ``column`` in stored order, read with plain mosaicml-streaming (as LLM Foundry does)."""
    dataset = StreamingDataset(local=str(split_dir))
    try:
        return [dataset[index][column] for index in range(len(dataset))]
    finally:
        release_shared_memory(dataset)


def expected_samples(documents: list[str], tokenizer, max_seq_len: int) -> list[list[int]]:
    stream = []
    for document in documents:
        stream += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return [stream[i : i + max_seq_len] for i in range(0, len(stream) - max_seq_len + 1, max_seq_len)]


def test_concat_tokens_writes_llm_foundry_tokens_column(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    summary = convert_to_mds(
        inputs,
        tmp_path / "mds",
        tokenizer=str(tiny_tokenizer_dir),
        max_seq_len=16,
        eval_fraction=0.25,
        progress=False,
    )
    train_documents, val_documents = split_documents(DOCUMENTS, 0.25)
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    index = json.loads((tmp_path / "mds" / "train" / "index.json").read_text())
    assert index["shards"][0]["column_names"] == ["tokens"]
    assert index["shards"][0]["column_encodings"] == ["ndarray:int32"]
    train = read_column(tmp_path / "mds" / "train", "tokens")
    assert [sample.tolist() for sample in train] == expected_samples(train_documents, tokenizer, 16)
    val = read_column(tmp_path / "mds" / "val", "tokens")
    assert [sample.tolist() for sample in val] == expected_samples(val_documents, tokenizer, 16)
    assert summary.splits["train"].samples == len(train)
    assert summary.splits["train"].tokens == 16 * len(train)


def test_raw_text_writes_one_text_sample_per_document(tmp_path: Path) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    summary = convert_to_mds(inputs, tmp_path / "mds", concat_tokens=False, eval_fraction=0.0, progress=False)
    assert read_column(tmp_path / "mds" / "train", "text") == DOCUMENTS
    assert summary.column == "text"
    assert not (tmp_path / "mds" / "val").exists()


def test_concat_without_tokenizer_trains_and_saves_one(tmp_path: Path) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS * 4)
    summary = convert_to_mds(inputs, tmp_path / "mds", max_seq_len=16, vocab_size=280, progress=False)
    assert summary.tokenizer_path == str(tmp_path / "mds" / "tokenizer")
    assert len(load_tokenizer(summary.tokenizer_path)) == 280


def test_split_keeps_all_text_and_gives_val_the_tail() -> None:
    documents = ["a" * 50 + "\n", "b\n" * 25, "c" * 50 + "\n"]
    train, val = split_documents(documents, 0.4)
    assert "".join(train) + "".join(val) == "".join(documents)
    assert val == ["b\n" * 5, documents[2]]  # the straddling document is cut at a line break


def test_single_document_is_split_at_a_line_break() -> None:
    train, val = split_documents(["line\n" * 100], 0.1)
    assert len(train[0]) == 450 and val == ["line\n" * 10]


def test_jsonl_rows_are_documents(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n')
    assert read_documents([path]) == ["first", "second"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: not valid JSON"):
        read_documents([path])


def test_jsonl_row_without_text_names_line_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "no text field"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:1: .*\['content'\]"):
        read_documents([path])


def test_folder_inputs_are_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    write_documents(tmp_path / "in" / "b", ["third"])
    write_documents(tmp_path / "in" / "a", ["first", "second"])
    (tmp_path / "in" / "notes.md").write_text("ignored")
    assert read_documents([tmp_path / "in"]) == ["first", "second", "third"]


def test_existing_output_without_overwrite_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "mds").mkdir()
    (tmp_path / "mds" / "keep.txt").write_text("old")
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    with pytest.raises(DataError, match="--overwrite"):
        convert_to_mds(inputs, tmp_path / "mds", concat_tokens=False, progress=False)
    assert (tmp_path / "mds" / "keep.txt").read_text() == "old"


def test_overwrite_replaces_existing_output(tmp_path: Path) -> None:
    (tmp_path / "mds").mkdir()
    (tmp_path / "mds" / "keep.txt").write_text("old")
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    convert_to_mds(inputs, tmp_path / "mds", concat_tokens=False, overwrite=True, progress=False)
    assert sorted(path.name for path in (tmp_path / "mds").iterdir()) == ["train", "val"]


def test_output_folders_follow_the_umask(tmp_path: Path) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    previous_umask = os.umask(0o022)
    try:
        convert_to_mds(inputs, tmp_path / "mds", concat_tokens=False, progress=False)
    finally:
        os.umask(previous_umask)
    assert (tmp_path / "mds").stat().st_mode & 0o777 == 0o755


def test_interrupted_conversion_leaves_nothing_behind(tmp_path: Path, tiny_tokenizer_dir: Path, monkeypatch) -> None:
    def fail_midway(documents, tokenizer, max_seq_len):
        yield np.zeros(max_seq_len, dtype=np.int32)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_token_samples", fail_midway)
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    with pytest.raises(KeyboardInterrupt):
        convert_to_mds(inputs, tmp_path / "mds", tokenizer=str(tiny_tokenizer_dir), max_seq_len=16, progress=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in"]


def test_too_little_text_for_a_val_sample_is_explained(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS)
    with pytest.raises(DataError, match="val split would hold no samples"):
        convert_to_mds(inputs, tmp_path / "mds", tokenizer=str(tiny_tokenizer_dir), max_seq_len=64, progress=False)


def test_unknown_compression_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Did you mean 'zstd'"):
        convert_to_mds(None, tmp_path / "mds", max_seq_len=16, compression="zstdd", progress=False)


def test_cli_converts_files_with_llm_foundry_flag_spellings(
    tmp_path: Path, tiny_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = write_documents(tmp_path / "in", DOCUMENTS * 4)
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    argv = [*map(str, inputs), "--out_root", str(tmp_path / "mds"), "--concat_tokens", "16"]
    args = parser.parse_args([*argv, "--tokenizer", str(tiny_tokenizer_dir), "--compression", "zstd", "--no-progress"])
    assert run_convert(args) == 0
    assert "train:" in capsys.readouterr().out
    assert (tmp_path / "mds" / "val" / "index.json").is_file()


def test_shared_gpt_neox_converts_tinyshakespeare(tmp_path: Path, shared_data: Path) -> None:
    text = (shared_data / "corpus" / "tinyshakespeare" / "input.txt").read_text()[:20_000]
    (tmp_path / "shakespeare.txt").write_text(text)
    tokenizer_dir = str(shared_data / "tokenizers" / "gpt-neox-20b")
    summary = convert_to_mds(
        [tmp_path / "shakespeare.txt"],
        tmp_path / "mds",
        tokenizer=tokenizer_dir,
        max_seq_len=64,
        eval_fraction=0.1,
        progress=False,
    )
    train = read_column(tmp_path / "mds" / "train", "tokens")
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.decode(np.concatenate(train).tolist()) == text[: len(tokenizer.decode(np.concatenate(train)))]
    assert summary.splits["val"].samples > 0


def test_128k_token_samples_convert_and_load_whole(tmp_path: Path, tiny_tokenizer_dir: Path, make_loader) -> None:
    """Nothing caps a sample's length (``--concat-tokens 131072``): samples are written and read back whole."""
    max_seq_len = 131072
    words = " ".join(f"w{index % 997}" for index in range(max_seq_len // 2))  # about 5 tokens a word
    inputs = write_documents(tmp_path / "in", [words])
    convert_to_mds(inputs, tmp_path / "mds", tokenizer=str(tiny_tokenizer_dir), max_seq_len=max_seq_len,
                   eval_fraction=0.0, progress=False)  # fmt: skip
    want = expected_samples([words], load_tokenizer(str(tiny_tokenizer_dir)), max_seq_len)
    assert len(want) == 2
    dataset = {"local": str(tmp_path / "mds"), "split": "train", "max_seq_len": max_seq_len, "shuffle": False}
    batches = list(make_loader(dataset=dataset, device_batch_size=1))
    assert [batch["input_ids"].shape for batch in batches] == [(1, max_seq_len)] * 2
    assert [batch["input_ids"][0].tolist() for batch in batches] == want
