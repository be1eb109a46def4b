"""The classes behind the ``text`` loader, subclasses of mosaicml-streaming's; importing this imports streaming.

``foundry.data.text.build_text_dataloader`` imports this module only after ``import_streaming`` has
checked that streaming is installed, so ``import foundry.data`` works without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from streaming import StreamingDataset
from streaming.base.dataloader import StreamingDataLoader
from transformers import PreTrainedTokenizerBase

from foundry.batches import SAMPLE_INDEX_KEY
from foundry.data.mds import rebuild_hint, shard_damage, shard_of_sample
from foundry.data.shm_prefix import elected_shm_prefixes, release_shared_memory
from foundry.errors import DataError


class StreamingTextDataset(StreamingDataset):
    """Reads ``tokens`` or ``text`` samples as ``{"input_ids": (max_seq_len,)}`` tensors.

    Args:
        tokenizer: tokenizes ``text`` samples; unused (may be None) for ``tokens`` samples.
        max_seq_len: tokens per sample; longer samples are truncated, shorter ``text`` padded.
        token_encoding_type: numpy dtype of ``tokens`` stored as raw bytes (LLM Foundry's old format).
        sample_indices: add ``sample_index``, the sample's index in the dataset, to each sample.
        **streaming_kwargs: passed to ``StreamingDataset``.
    """

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        max_seq_len: int,
        token_encoding_type: str = "int64",
        sample_indices: bool = False,
        **streaming_kwargs: Any,
    ) -> None:
        with elected_shm_prefixes():  # jobs on one host keep apart (foundry/data/shm_prefix.py)
            super().__init__(**streaming_kwargs)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.token_encoding_type = token_encoding_type
        self.sample_indices = sample_indices
        self._checked_shards: set[Path] = set()
        self._vocab_size: int | None = None

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self._read(index)
        if self.sample_indices:
            sample[SAMPLE_INDEX_KEY] = torch.tensor(index, dtype=torch.int64)
        return sample

    def _read(self, index: int) -> dict[str, torch.Tensor]:
        sample = self._stored_sample(index)
        self._check_shard(index)
        if "tokens" in sample:
            input_ids = self._read_tokens(sample["tokens"])[: self.max_seq_len]
            self._check_token_ids(index, input_ids)
            return {"input_ids": input_ids}
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
        sample = self._stored_sample(0)
        if "tokens" in sample:
            return "tokens", len(self._read_tokens(sample["tokens"]))
        if "text" in sample:
            return "text", None
        raise DataError(
            f"The dataset at {self.location()} has columns {sorted(sample)}; the text dataloader reads a 'tokens' "
            f"or a 'text' column. Re-create it with 'foundry data convert'."
        )

    def _stored_sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as streaming reads it; a damaged shard (its header, its data) is a ``DataError``."""
        try:
            return super().__getitem__(index)
        except Exception as exc:  # what streaming raises for a damaged shard: IndexError, ValueError, ...
            raise self._unreadable(index, exc) from exc

    def _check_shard(self, index: int) -> None:
        """The first sample read from a shard checks the whole shard file (size, and checksum when recorded)."""
        path, info, local = shard_of_sample(self, index)
        if path in self._checked_shards:
            return
        damage = shard_damage(path, info)
        if damage:
            raise DataError(f"Shard {path} is damaged: {damage}. {rebuild_hint(local)}")
        self._checked_shards.add(path)

    def _unreadable(self, index: int, exc: Exception) -> DataError:
        path, info, local = shard_of_sample(self, index)
        damage = shard_damage(path, info) or f"sample {index} cannot be read ({type(exc).__name__}: {exc})"
        return DataError(f"Shard {path} is damaged: {damage}. {rebuild_hint(local)}")

    def _check_token_ids(self, index: int, input_ids: torch.Tensor) -> None:
        """Token ids beyond the tokenizer's vocabulary: data from another tokenizer, or damage the shard's
        checksum (when it has none) did not catch. Without this the model fails with an IndexError."""
        if self._vocab_size is None and self.tokenizer is not None:
            self._vocab_size = len(self.tokenizer)
        if self._vocab_size is not None and input_ids.numel() and int(input_ids.max()) >= self._vocab_size:
            path, _, local = shard_of_sample(self, index)
            raise DataError(
                f"Sample {index} (in shard {path}) holds token id {int(input_ids.max())}, but the tokenizer has "
                f"{self._vocab_size} tokens: the data was tokenized with another tokenizer, or the shard is damaged. "
                f"Set the run's tokenizer to the one the data was converted with, or {rebuild_hint(local)[0].lower()}"
                f"{rebuild_hint(local)[1:]}"
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
