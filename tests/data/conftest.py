"""Data fixtures: a tiny trained tokenizer, tiny MDS datasets, and loaders whose shared memory is freed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from foundry.data import build_text_dataloader, builtin_corpus_documents, train_bpe_tokenizer

DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.\nIt was not amused.\n",
    "A second document, with numbers 1 2 3 and symbols !?\n",
    "Third: tokens are cut into samples of exactly the same length.\n",
    "Fourth and last document closes the tiny corpus.\n",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token byte-level BPE tokenizer trained on a few help topics."""
    out_dir = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(builtin_corpus_documents()[:4], vocab_size=300, out_dir=out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from foundry.data import load_tokenizer

    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture
def make_loader() -> Iterator[Callable[..., Any]]:
    """``build_text_dataloader`` that closes every dataset it built when the test ends."""
    loaders = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("tokenizer", None)
        kwargs.setdefault("device_batch_size", 2)
        loader = build_text_dataloader(**kwargs)
        loaders.append(loader)
        return loader

    yield make
    for loader in loaders:
        loader.dataset.close()


def write_documents(folder: Path, documents: list[str]) -> list[Path]:
    """One .txt file per document, named so that sorted order is document order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, document in enumerate(documents):
        path = folder / f"doc{index:03d}.txt"
        path.write_text(document, encoding="utf-8")
        paths.append(path)
    return paths
