"""The ``text`` dataloader: LLM Foundry's streaming MDS text datasets, resumable mid-epoch.

A dataset written by ``foundry data convert`` (or by LLM Foundry's converters) holds either a
``tokens`` column (pre-tokenized, concatenated samples) or a ``text`` column (raw documents,
tokenized here on the fly and right-padded). From Python::

    from foundry.data import build_text_dataloader, load_tokenizer

    loader = build_text_dataloader(
        tokenizer=load_tokenizer("data/quickstart/tokenizer"),  # None is fine for a `tokens` column
        device_batch_size=8,
        dataset={"local": "data/quickstart", "split": "train", "max_seq_len": 256, "shuffle": True},
    )
    for batch in loader:
        batch["input_ids"]  # (8, 256) int64; plus attention_mask and labels when the batch has padding
    state = loader.state_dict()  # a fresh loader given load_state_dict(state) resumes after the last batch
    loader.dataset.close()  # optional: free shared memory now instead of at process exit

Every StreamingDataset takes a few named shared-memory blocks and two lock files in the temp
folder, released at process exit. Processes that build many datasets (tests, notebooks) call
``dataset.close()``. Which names a dataset takes is elected per job (``foundry.data.shm_prefix``), so jobs
on one host keep apart and a killed job's leftovers are skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from foundry import registry
from foundry.core.bounds import check_bounds
from foundry.data.collate import collate_lm_samples
from foundry.data.config import LOADER_DEFAULTS
from foundry.data.mds import build_checked_streams, check_local_dataset, import_streaming
from foundry.errors import ConfigError
from foundry.schema import parse_dataclass

if TYPE_CHECKING:
    from foundry.data.text_dataset import StreamingTextDataset

TokenEncoding = Literal["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@dataclass
class TextDatasetConfig:
    """The ``<loader>.dataset`` keys of LLM Foundry's ``text`` loader.

    Keys left at None take mosaicml-streaming's own defaults (see ``streaming.StreamingDataset``).
    """

    max_seq_len: int
    local: str | None = None
    remote: str | None = None  # None or "" reads `local` only
    split: str | None = None
    shuffle: bool = False
    shuffle_seed: int | None = None
    streams: dict[str, dict[str, Any]] | None = None  # name -> streaming.Stream kwargs, for mixtures
    token_encoding_type: TokenEncoding = "int64"  # dtype of a legacy `tokens` column stored as bytes
    eos_token_id: int | None = None  # LLM Foundry's sequence_id trigger; not supported (see _reject_...)
    bos_token_id: int | None = None
    num_canonical_nodes: int | None = None
    shuffle_algo: str | None = None
    shuffle_block_size: int | None = None
    predownload: int | None = None
    download_retry: int | None = None
    download_timeout: float | None = None
    validate_hash: str | None = None
    keep_zip: bool | None = None
    epoch_size: int | str | None = None
    sampling_method: str | None = None
    sampling_granularity: int | None = None
    batching_method: str | None = None
    cache_limit: int | str | None = None
    partition_algo: str | None = None

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive number of tokens, got {self.max_seq_len}")
        if self.remote == "":
            self.remote = None

    def streaming_kwargs(self) -> dict[str, Any]:
        """The keys StreamingDataset takes itself, minus those left to its defaults."""
        own = {"max_seq_len", "streams", "token_encoding_type", "eos_token_id", "bos_token_id"}
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in own and getattr(self, field.name) is not None
        }


@registry.dataloaders.register("text")
def build_text_dataloader(
    *,
    device_batch_size: int,
    dataset: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase | None = None,
    drop_last: bool = LOADER_DEFAULTS.drop_last,
    num_workers: int = LOADER_DEFAULTS.num_workers,
    pin_memory: bool = LOADER_DEFAULTS.pin_memory,
    prefetch_factor: int | None = LOADER_DEFAULTS.prefetch_factor,
    persistent_workers: bool = LOADER_DEFAULTS.persistent_workers,
    timeout: float = LOADER_DEFAULTS.timeout,
    key_path: str = "train_loader",
    sample_indices: bool = False,
    replication: int = 1,
) -> DataLoader:
    """Build LLM Foundry's ``text`` loader over a local (or remote) MDS dataset.

    The loader keys (``drop_last``, ``num_workers``...) default to the YAML's (``foundry.data.config.LoaderConfig``).

    Args:
        tokenizer: needed only for datasets with a raw ``text`` column.
        device_batch_size: samples per batch on this device.
        dataset: the ``TextDatasetConfig`` keys (LLM Foundry's ``<loader>.dataset`` section).
        key_path: where this loader sits in the YAML, for error messages.
        sample_indices: add each sample's index in the dataset as ``batch["sample_index"]`` (eval
            loaders: streaming pads the ranks' shares with repeated samples, which evaluation then
            counts once; ``foundry.batches.drop_repeated_samples``).
        replication: how many consecutive ranks load the same samples (tensor parallelism; streaming's
            ``replication``).

    Returns:
        A ``TextDataLoader`` (a ``StreamingDataLoader``) whose ``state_dict()``/``load_state_dict()`` resume
        mid-epoch or at the start of the next epoch.
    """
    check_bounds({"num_workers": num_workers, "prefetch_factor": prefetch_factor, "timeout": timeout}, key_path)
    config = parse_dataclass(TextDatasetConfig, dataset, f"{key_path}.dataset")
    if device_batch_size < 1:
        raise ConfigError(f"'{key_path}.device_batch_size' is {device_batch_size}; it must be at least 1.")
    _reject_sequence_ids(config, key_path)
    import_streaming(f"The text dataloader '{key_path}'")
    # text_dataset imports mosaicml-streaming, which the GPU image lacks: only once it is known to import.
    from foundry.data.text_dataset import StreamingTextDataset, TextDataLoader

    streams = build_checked_streams(config, f"{key_path}.dataset")
    text_dataset = StreamingTextDataset(
        tokenizer=tokenizer,
        max_seq_len=config.max_seq_len,
        token_encoding_type=config.token_encoding_type,
        streams=streams,
        batch_size=device_batch_size,
        sample_indices=sample_indices,
        replication=replication if replication > 1 else None,
        **config.streaming_kwargs(),
    )
    try:
        _check_stored_format(text_dataset, tokenizer, f"{key_path}.dataset")
    except Exception:
        text_dataset.close()
        raise
    use_workers = num_workers > 0
    return TextDataLoader(
        text_dataset,
        batch_size=device_batch_size,
        collate_fn=collate_lm_samples,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        prefetch_factor=prefetch_factor if use_workers else None,  # torch rejects it without workers
        persistent_workers=persistent_workers and use_workers,
        timeout=timeout,
    )


# Run by `foundry train` before the tokenizer loads: a wrong data folder is named as such, not as the tokenizer
# that a YAML keeps inside it (LLM Foundry's and the quickstart's ${data_local}/tokenizer).
build_text_dataloader.check_dataset = check_local_dataset


def _reject_sequence_ids(config: TextDatasetConfig, key_path: str) -> None:
    for key in ("eos_token_id", "bos_token_id"):
        if getattr(config, key) is not None:
            raise ConfigError(
                f"'{key_path}.dataset.{key}' asks for LLM Foundry's sequence_id (attention masked at document "
                f"boundaries), which foundry does not build yet. Remove the key: samples then attend across "
                f"document boundaries, as LLM Foundry does by default."
            )


def _check_stored_format(
    dataset: StreamingTextDataset, tokenizer: PreTrainedTokenizerBase | None, key_path: str
) -> None:
    column, stored_tokens = dataset.stored_format()
    if column == "tokens" and stored_tokens is not None and stored_tokens < dataset.max_seq_len:
        raise ConfigError(
            f"'{key_path}.max_seq_len' is {dataset.max_seq_len}, but the samples in {dataset.location()} hold "
            f"{stored_tokens} tokens each. Set max_seq_len to {stored_tokens} or less, or re-convert the data "
            f"with 'foundry data convert ... --concat-tokens {dataset.max_seq_len}'."
        )
    if column == "text" and tokenizer is None:
        raise ConfigError(
            f"The dataset at {dataset.location()} stores raw 'text', so the text dataloader needs a tokenizer: "
            f"set the run's tokenizer section, or convert the data with 'foundry data convert --concat-tokens N'."
        )
