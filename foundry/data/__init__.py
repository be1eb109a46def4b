"""Data: the builtin corpus, tokenizers, text → MDS conversion, the ``text`` and ``finetuning`` dataloaders.

Importing this package does not import mosaicml-streaming (the GPU image lacks it): only MDS reading
and writing do, and ``StreamingTextDataset``/``TextDataLoader`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from foundry.data.mds import import_streaming
from foundry.lazy import lazy_exports

_EXPORTS = {
    "ConversionSummary": "foundry.data.convert",
    "FinetuningDataLoader": "foundry.data.finetuning",
    "SplitSummary": "foundry.data.convert",
    "TextDatasetConfig": "foundry.data.text",
    "build_finetuning_dataloader": "foundry.data.finetuning",
    "build_text_dataloader": "foundry.data.text",
    "builtin_corpus_documents": "foundry.data.corpus",
    "collate_lm_samples": "foundry.data.collate",
    "convert_to_mds": "foundry.data.convert",
    "import_streaming": "foundry.data.mds",
    "load_tokenizer": "foundry.data.tokenizer",
    "release_shared_memory": "foundry.data.shm_prefix",
    "train_bpe_tokenizer": "foundry.data.tokenizer",
}
_STREAMING_CLASSES = ("StreamingTextDataset", "TextDataLoader")  # in text_dataset, which imports streaming
__all__ = sorted([*_EXPORTS, *_STREAMING_CLASSES])
_lazy_getattr, __dir__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _STREAMING_CLASSES:
        return _lazy_getattr(name)
    import_streaming(f"foundry.data.{name}")
    return getattr(importlib.import_module("foundry.data.text_dataset"), name)
