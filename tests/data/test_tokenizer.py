from __future__ import annotations

from pathlib import Path

import pytest

from foundry.data import builtin_corpus_documents, load_tokenizer, train_bpe_tokenizer
from foundry.data.tokenizer import END_OF_TEXT
from foundry.errors import ConfigError, DataError


def test_bpe_training_is_deterministic(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    train_bpe_tokenizer(builtin_corpus_documents()[:4], vocab_size=300, out_dir=tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == (tiny_tokenizer_dir / "tokenizer.json").read_text()


def test_trained_tokenizer_loads_with_plain_auto_tokenizer(tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert {path.name for path in tiny_tokenizer_dir.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert len(tokenizer) == 300
    assert tokenizer.eos_token == tokenizer.pad_token == tokenizer.bos_token == END_OF_TEXT


def test_trained_tokenizer_round_trips_text(tiny_tokenizer) -> None:
    text = "Hello, world!\n\n  Indented — unicode ünïcode.\n"
    assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text


def test_vocab_size_below_byte_alphabet_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="vocab_size is 200"):
        train_bpe_tokenizer(["some text"], vocab_size=200, out_dir=tmp_path)


def test_missing_tokenizer_directory_names_path_and_fix(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "such_tokenizer")
    with pytest.raises(DataError, match="such_tokenizer") as error:
        load_tokenizer(missing)
    assert "tokenizer.name" in str(error.value)


def test_shared_gpt_neox_tokenizer_gets_eos_as_pad(shared_data: Path) -> None:
    tokenizer = load_tokenizer(str(shared_data / "tokenizers" / "gpt-neox-20b"))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0
