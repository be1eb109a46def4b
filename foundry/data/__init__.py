"""Data: the builtin corpus, tokenizers, text → MDS conversion, the ``text`` and ``finetuning`` dataloaders.

Importing this package does not import mosaicml-streaming (the GPU image lacks it): only MDS reading
and writing do, and ``StreamingTextDataset``/``TextDataLoader`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from foundry.data.collate import collate_lm_samples
from foundry.data.convert import ConversionSummary, SplitSummary, convert_to_mds
from foundry.data.corpus import builtin_corpus_documents
from foundry.data.finetuning import FinetuningDataLoader, build_finetuning_dataloader
from foundry.data.mds import import_streaming, release_shared_memory
from foundry.data.text import TextDatasetConfig, build_text_dataloader
from foundry.data.tokenizer import load_tokenizer, train_bpe_tokenizer

__all__ = [
    "ConversionSummary",
    "FinetuningDataLoader",
    "SplitSummary",
    "StreamingTextDataset",
    "TextDataLoader",
    "TextDatasetConfig",
    "build_finetuning_dataloader",
    "build_text_dataloader",
    "builtin_corpus_documents",
    "collate_lm_samples",
    "convert_to_mds",
    "load_tokenizer",
    "release_shared_memory",
    "train_bpe_tokenizer",
]

_STREAMING_CLASSES = ("StreamingTextDataset", "TextDataLoader")


def __getattr__(name: str) -> Any:
    if name not in _STREAMING_CLASSES:
        raise AttributeError(f"module 'foundry.data' has no attribute '{name}'")
    import_streaming(f"foundry.data.{name}")
    return getattr(importlib.import_module("foundry.data.text_dataset"), name)
