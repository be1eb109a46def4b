"""Data: the builtin corpus, tokenizers, text → MDS conversion, the ``text`` and ``finetuning`` dataloaders."""

from foundry.data.collate import collate_lm_samples
from foundry.data.convert import ConversionSummary, SplitSummary, convert_to_mds
from foundry.data.corpus import builtin_corpus_documents
from foundry.data.finetuning import FinetuningDataLoader, build_finetuning_dataloader
from foundry.data.text import (
    StreamingTextDataset,
    TextDataLoader,
    TextDatasetConfig,
    build_text_dataloader,
    release_shared_memory,
)
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
