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
``dataset.close()``. After a crash, stale blocks can make streaming refuse a reused ``local`` that
has a ``remote``; ``streaming.base.util.clean_stale_shared_memory()`` at job start clears them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from streaming import Stream, StreamingDataset
from streaming.base.dataloader import StreamingDataLoader
from transformers import PreTrainedTokenizerBase  # streaming imports transformers anyway

from foundry import registry
from foundry.data.collate import collate_lm_samples
from foundry.errors import ConfigError, DataError
from foundry.schema import check_call_kwargs, parse_dataclass

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


class StreamingTextDataset(StreamingDataset):
    """Reads ``tokens`` or ``text`` samples as ``{"input_ids": (max_seq_len,)}`` tensors.

    Args:
        tokenizer: tokenizes ``text`` samples; unused (may be None) for ``tokens`` samples.
        max_seq_len: tokens per sample; longer samples are truncated, shorter ``text`` padded.
        token_encoding_type: numpy dtype of ``tokens`` stored as raw bytes (LLM Foundry's old format).
        **streaming_kwargs: passed to ``StreamingDataset``.
    """

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        max_seq_len: int,
        token_encoding_type: str = "int64",
        **streaming_kwargs: Any,
    ) -> None:
        super().__init__(**streaming_kwargs)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.token_encoding_type = token_encoding_type

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(index)
        if "tokens" in sample:
            return {"input_ids": self._read_tokens(sample["tokens"])[: self.max_seq_len]}
        if "text" in sample:
            return self._tokenize(sample["text"])
        raise DataError(
            f"Sample {index} has columns {sorted(sample)}; the text dataloader reads a 'tokens' or a 'text' column "
            f"(as written by 'foundry data convert' or LLM Foundry's converters)."
        )

    def stored_format(self) -> tuple[str, int | None]:
        """The first sample's column, and its token count for a ``tokens`` column (None for text)."""
        if self.num_samples == 0:
            raise DataError(f"The dataset at {self.location()} holds no samples. Re-convert it with more data.")
        sample = super().__getitem__(0)
        if "tokens" in sample:
            return "tokens", len(self._read_tokens(sample["tokens"]))
        if "text" in sample:
            return "text", None
        raise DataError(
            f"The dataset at {self.location()} has columns {sorted(sample)}; the text dataloader reads a 'tokens' "
            f"or a 'text' column. Re-create it with 'foundry data convert'."
        )

    def close(self) -> None:
        """Release this dataset's shared memory and lock files now rather than at process exit."""
        release_shared_memory(self)

    def _read_tokens(self, stored: np.ndarray | bytes) -> torch.Tensor:
        if isinstance(stored, bytes):
            stored = np.frombuffer(stored, dtype=np.dtype(self.token_encoding_type))
        return torch.tensor(stored, dtype=torch.int64)  # copies: MDS arrays are read-only views

    def _tokenize(self, text: str) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            raise DataError(
                f"The dataset at {self.location()} stores raw 'text'; pass a tokenizer to the text dataloader "
                f"(the run's tokenizer section) or convert it to tokens with 'foundry data convert --concat-tokens N'."
            )
        token_ids = self.tokenizer(text, truncation=True, max_length=self.max_seq_len)["input_ids"]
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:  # padding is masked out, so any id works; eos keeps ids inside the vocab
            pad_id = self.tokenizer.eos_token_id or 0
        num_pad = self.max_seq_len - len(token_ids)
        input_ids = torch.tensor(list(token_ids) + [pad_id] * num_pad, dtype=torch.int64)
        attention_mask = torch.ones(self.max_seq_len, dtype=torch.int64)
        attention_mask[len(token_ids) :] = 0
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def location(self) -> str:
        """Where the samples come from, for error messages."""
        return ", ".join(f"{stream.local} (split '{stream.split}')" for stream in self.streams)


def release_shared_memory(dataset: StreamingDataset) -> None:
    """Free a StreamingDataset's shared-memory blocks and temp-folder lock files (it must be idle).

    Streaming frees them only at process exit; this reaches into its private attributes, each
    looked up defensively so that a streaming version without one skips it.
    """
    holders = [
        getattr(dataset, "_locals_shm", None),
        getattr(getattr(getattr(dataset, "_shared_barrier", None), "_arr", None), "shm", None),
        *(getattr(getattr(getattr(dataset, name, None), "arr", None), "shm", None) for name in _SCALARS),
        *(getattr(getattr(dataset, name, None), "shm", None) for name in _ARRAYS),
        getattr(dataset, "_resume_shm", None),
    ]
    for shared_memory in filter(None, holders):
        shared_memory.cleanup()
        atexit.unregister(shared_memory.cleanup)
    barrier_lock = getattr(getattr(dataset, "_shared_barrier", None), "filelock_path", None)
    for path in (getattr(dataset, "_cache_filelock_path", None), barrier_lock):
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


_SCALARS = ("_next_epoch", "_cache_usage")
_ARRAYS = ("_shard_states", "_shard_access_times")


class TextDataLoader(StreamingDataLoader):
    """A StreamingDataLoader whose state, once an epoch is fully read, points at the next epoch.

    Streaming's own state would resume the finished epoch and yield nothing for one pass, so a run
    checkpointed at an epoch boundary would lose an epoch of its schedule.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_finished = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.epoch_finished = False
        yield from super().__iter__()
        self.epoch_finished = True

    def state_dict(self) -> dict[str, Any] | None:
        state = super().state_dict()
        if state is not None and self.epoch_finished:
            state = {**state, "epoch": state["epoch"] + 1, "sample_in_epoch": 0}
        return state


@registry.dataloaders.register("text")
def build_text_dataloader(
    *,
    device_batch_size: int,
    dataset: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase | None = None,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
    persistent_workers: bool = False,
    timeout: float = 0,
    key_path: str = "train_loader",
) -> TextDataLoader:
    """Build LLM Foundry's ``text`` loader over a local (or remote) MDS dataset.

    Args:
        tokenizer: needed only for datasets with a raw ``text`` column.
        device_batch_size: samples per batch on this device.
        dataset: the ``TextDatasetConfig`` keys (LLM Foundry's ``<loader>.dataset`` section).
        key_path: where this loader sits in the YAML, for error messages.

    Returns:
        A ``StreamingDataLoader`` whose ``state_dict()``/``load_state_dict()`` resume mid-epoch or at
        the start of the next epoch.
    """
    config = parse_dataclass(TextDatasetConfig, dataset, f"{key_path}.dataset")
    if device_batch_size < 1:
        raise ConfigError(f"'{key_path}.device_batch_size' is {device_batch_size}; it must be at least 1.")
    _reject_sequence_ids(config, key_path)
    streams = build_checked_streams(config, f"{key_path}.dataset")
    text_dataset = StreamingTextDataset(
        tokenizer=tokenizer,
        max_seq_len=config.max_seq_len,
        token_encoding_type=config.token_encoding_type,
        streams=streams,
        batch_size=device_batch_size,
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


def _reject_sequence_ids(config: TextDatasetConfig, key_path: str) -> None:
    for key in ("eos_token_id", "bos_token_id"):
        if getattr(config, key) is not None:
            raise ConfigError(
                f"'{key_path}.dataset.{key}' asks for LLM Foundry's sequence_id (attention masked at document "
                f"boundaries), which foundry does not build yet. Remove the key: samples then attend across "
                f"document boundaries, as LLM Foundry does by default."
            )


def build_checked_streams(config: Any, key_path: str) -> list[Stream] | None:
    """``config.streams`` as Streams (None without), each local-only one checked to exist on disk.

    ``config`` has the dataset keys ``streams``, ``local``, ``remote`` and ``split``; ``key_path`` names it.
    """
    streams = _build_streams(config, key_path)
    for local, remote, split in _stream_locations(config):
        _check_local_split(local, remote, split, key_path)
    return streams


def _build_streams(config: Any, key_path: str) -> list[Stream] | None:
    if not config.streams:
        return None
    return [
        Stream(**check_call_kwargs(Stream, kwargs, f"{key_path}.streams.{name}"))
        for name, kwargs in config.streams.items()
    ]


def _stream_locations(config: Any) -> list[tuple[str | None, str | None, str | None]]:
    """(local, remote, split) of each stream, with the dataset-level keys as defaults."""
    if not config.streams:
        return [(config.local, config.remote, config.split)]
    return [
        (
            stream.get("local", config.local),
            stream.get("remote", config.remote) or None,
            stream.get("split", config.split),
        )
        for stream in config.streams.values()
    ]


def _check_local_split(local: str | None, remote: str | None, split: str | None, key_path: str) -> None:
    """Without a remote, the data must already sit in ``local/split``; say how to get it there."""
    if remote:
        return
    if local is None:
        raise ConfigError(f"'{key_path}.local' is not set and there is no remote: set it to an MDS dataset folder.")
    root = Path(local)
    split_dir = root / split if split else root
    if not root.is_dir():
        raise DataError(
            f"No dataset at '{local}' (split '{split}'): the folder does not exist and '{key_path}.remote' is empty. "
            f"Create it with 'foundry data convert <files> --out {local} --concat-tokens <max_seq_len>', "
            f"or set '{key_path}.remote' to where the dataset is stored."
        )
    if not (split_dir / "index.json").is_file():
        splits = sorted(child.name for child in root.iterdir() if (child / "index.json").is_file())
        raise DataError(
            f"No MDS dataset (index.json) at '{split_dir}' for split '{split}'. "
            f"Splits in '{local}': {', '.join(splits) or 'none'}. Set '{key_path}.split' to one of them, "
            f"or re-create the dataset with 'foundry data convert ... --out {local}'."
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
