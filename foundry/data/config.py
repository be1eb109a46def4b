"""The data sections of a run: which tokenizer, and how a dataloader batches (LLM Foundry's loader keys).

The ``text`` and ``finetuning`` builders take these keys as keyword arguments with these defaults
(``LOADER_DEFAULTS``); the YAML's ``train_loader`` / ``eval_loader`` sections are ``LoaderConfig``s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Literal

from foundry.schema import doc, field_defaults


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    name: str = field(metadata=doc("Hugging Face tokenizer name or local folder"))
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=doc("passed to the tokenizer's from_pretrained"))


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """A dataloader: ``name`` picks a registered builder; the other keys are its arguments."""

    name: str = field(metadata=doc("registered dataloader, e.g. text"))
    dataset: dict[str, Any] = field(
        default_factory=dict, metadata=doc("the dataset's own keys (local, split, max_seq_len...)")
    )
    label: str | None = field(default=None, metadata=doc("eval metrics are logged as metrics/<label>/..."))
    drop_last: bool = field(default=False, metadata=doc("drop the last incomplete batch"))
    num_workers: int = field(default=0, metadata=doc("dataloader worker processes"))
    pin_memory: bool = field(default=True, metadata=doc("page-locked host memory for faster copies to the GPU"))
    prefetch_factor: int | None = field(
        default=None, metadata=doc("batches each worker loads ahead (torch's default when None)")
    )
    persistent_workers: bool = field(
        default=False, metadata=doc("keep workers alive between epochs (needs num_workers > 0)")
    )
    timeout: float = field(default=0.0, metadata=doc("seconds to wait for a batch from a worker (0 = forever)"))


LOADER_DEFAULTS = field_defaults(LoaderConfig)

# How an example longer than max_seq_len is cut (LLM Foundry keeps its start).
Truncation = Literal["keep_start", "keep_end", "drop"]


@dataclasses.dataclass
class RowsDatasetConfig:
    """The ``<loader>.dataset`` keys the ``finetuning`` and ``preference`` loaders share: the source of their rows
    (read once, in the training process), their order and their packing."""

    max_seq_len: int
    hf_name: str | None = None  # a local .jsonl file or folder, or 'json' with hf_kwargs (Hub ids are refused)
    hf_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # 'json': data_files or data_dir
    local: str | None = None  # MDS dataset
    remote: str | None = None
    streams: dict[str, dict[str, Any]] | None = None
    split: str | None = None
    shuffle: bool = False
    shuffle_seed: int = 9176  # mosaicml-streaming's default, as LLM Foundry
    packing_ratio: float | str | None = None  # examples (pairs) drawn per row; 'auto' profiles; None or 1: no packing
    eos_token_id: int | None = None  # ends every response; default: the tokenizer's eos
    download_retry: int | None = None
    download_timeout: float | None = None
    validate_hash: str | None = None
    keep_zip: bool | None = None
    predownload: int | None = None
    cache_limit: int | str | None = None

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive number of tokens, got {self.max_seq_len}")


@dataclasses.dataclass
class FinetuningDatasetConfig(RowsDatasetConfig):
    """The ``<loader>.dataset`` keys of LLM Foundry's ``finetuning`` loader (plus ``truncation``)."""

    preprocessing_fn: str | dict[str, str] | None = None  # 'module:function' or {prompt: column, response: column}
    target_prompts: str = "none"  # 'none', 'all' or 'length>=N'
    target_responses: Literal["last", "all"] = "last"
    truncation: Truncation = "keep_start"  # LLM Foundry keeps the first max_seq_len tokens
    allow_pad_trimming: bool = False
    decoder_only_format: bool = True
    safe_load: bool | None = None  # LLM Foundry's remote-code guard; local files need none
    token_encoding_type: str = "int64"  # dtype of pre-tokenized MDS columns stored as bytes


@dataclasses.dataclass
class PreferenceDatasetConfig(RowsDatasetConfig):
    """The ``<loader>.dataset`` keys of the ``preference`` loader (an MDS ``local`` has prompt/chosen/rejected)."""

    builtin: bool = False  # the pairs derived from Python's help topics (foundry.data.corpus), no file needed
