"""Damaged MDS data stops the text loader with a message naming the shard, what is wrong and how to rebuild."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import flip_byte

from foundry.cli import main
from foundry.data import convert_to_mds
from foundry.errors import DataError
from tests.data.conftest import DOCUMENTS, write_documents

pytest.importorskip("streaming")

REBUILD = r"foundry data convert <your inputs> --out .* --overwrite"


@pytest.fixture
def dataset(tmp_path: Path, tiny_tokenizer_dir: Path) -> Path:
    inputs = write_documents(tmp_path / "in", DOCUMENTS * 4)
    convert_to_mds(inputs, tmp_path / "mds", tokenizer=str(tiny_tokenizer_dir), max_seq_len=8, eval_fraction=0.0,
                   progress=False)  # fmt: skip
    return tmp_path / "mds"


def _shard(dataset: Path) -> Path:
    return dataset / "train" / "shard.00000.mds"


def _first_batch(make_loader, dataset: Path, **kwargs) -> dict:
    loader = make_loader(dataset={"local": str(dataset), "split": "train", "max_seq_len": 8}, **kwargs)
    return next(iter(loader))


def test_convert_records_each_shard_checksum_in_the_index(dataset: Path) -> None:
    index = json.loads((dataset / "train" / "index.json").read_text())
    assert set(index["shards"][0]["raw_data"]["hashes"]) == {"xxh3_64"}


def test_a_flipped_byte_in_a_shard_is_named_at_its_first_read(dataset: Path, make_loader) -> None:
    flip_byte(_shard(dataset))
    with pytest.raises(DataError, match=rf"shard.00000.mds is damaged: its xxh3_64 checksum differs.*{REBUILD}"):
        _first_batch(make_loader, dataset)


def test_a_truncated_shard_is_named_before_training(dataset: Path, make_loader) -> None:
    shard = _shard(dataset)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match=rf"shard.00000.mds has 100 bytes where .*index.json says {size}.*{REBUILD}"):
        make_loader(dataset={"local": str(dataset), "split": "train", "max_seq_len": 8})


def test_a_missing_shard_is_named_before_training(dataset: Path, make_loader) -> None:
    _shard(dataset).unlink()
    with pytest.raises(DataError, match=rf"shard.00000.mds, listed in .*index.json, is missing.*{REBUILD}"):
        make_loader(dataset={"local": str(dataset), "split": "train", "max_seq_len": 8})


def test_a_truncated_index_is_named_before_training(dataset: Path, make_loader) -> None:
    index = dataset / "train" / "index.json"
    index.write_text(index.read_text()[:50])
    with pytest.raises(DataError, match=rf"index.json is damaged \(JSONDecodeError.*{REBUILD}"):
        make_loader(dataset={"local": str(dataset), "split": "train", "max_seq_len": 8})


class _SmallVocabulary:
    """A tokenizer of 5 tokens: the data's ids lie beyond it, as after damage or with the wrong tokenizer."""

    eos_token_id = pad_token_id = 0

    def __len__(self) -> int:
        return 5


def test_token_ids_beyond_the_tokenizer_are_named_not_an_index_error(dataset: Path, make_loader) -> None:
    with pytest.raises(DataError, match=r"holds token id \d+, but the tokenizer has 5 tokens.*another tokenizer"):
        _first_batch(make_loader, dataset, tokenizer=_SmallVocabulary())


def test_converting_inputs_without_text_is_refused(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n")
    assert main(["data", "convert", str(empty), str(blank), "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "empty.jsonl" in message and "hold no text" in message and "Pass files that hold documents" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("header", [b"\xff" * 16, b"\x00" * 16], ids=["huge-offsets", "zero-offsets"])
def test_a_damaged_shard_header_is_named_before_training(dataset: Path, make_loader, header: bytes) -> None:
    shard = _shard(dataset)
    shard.write_bytes(header + shard.read_bytes()[len(header) :])
    with pytest.raises(DataError, match=rf"shard.00000.mds is damaged: .*{REBUILD}"):
        _first_batch(make_loader, dataset)
