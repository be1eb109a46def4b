"""The ``preference`` dataloader: (prompt, chosen, rejected) pairs for DPO and its variants.

Rows come from the same sources as the ``finetuning`` loader (a local ``.jsonl`` file or folder, or an MDS
dataset) and take one of two forms:

- text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``, tokenized as finetuning prompt/response rows
  (the prompt with the tokenizer's special tokens, each response without, then eos);
- chat: ``chosen`` and ``rejected`` are lists of ``{role, content}`` messages ending with the assistant's reply,
  after an optional ``prompt`` list (without one, the two conversations share every message but their last
  reply: TRL's implicit prompt). The tokenizer's chat template renders them (``foundry.data.chat``).

Each batch holds ``input_ids``, ``labels`` and ``attention_mask``, all (pairs, 2, seq): row 0 of a pair is
prompt + chosen, row 1 prompt + rejected, right-padded to the batch's longest; labels are -100 on the prompt
and padding. Splitting along the first dimension keeps a pair together, and ``input_ids.numel()`` counts the
chosen and rejected tokens both.

With ``packing_ratio`` (as the ``finetuning`` loader's), several pairs share a row pair: row 0 holds their
prompt + chosen sequences one after another, row 1 their prompt + rejected ones in the same order, and
``sequence_id`` / ``position_ids`` (pairs, 2, seq) mark each sequence (-1 on padding) and restart its positions.
A model that masks attention between sequences (``attn_uses_sequence_id``) computes exactly what it computes
on the pairs unpacked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foundry import registry
from foundry.batches import IGNORE_INDEX
from foundry.core.bounds import check_bounds
from foundry.data.chat import MESSAGES_KEYS, RowFormatError, chat_renderer
from foundry.data.config import LOADER_DEFAULTS, PreferenceDatasetConfig
from foundry.data.corpus import builtin_preference_rows
from foundry.data.finetuning_examples import token_turns
from foundry.data.finetuning_rows import check_rows_loader, read_rows
from foundry.data.mds import check_local_dataset
from foundry.data.packing import pack_rows, rank_batches, resolve_packing_ratio
from foundry.distributed.env import get_rank, get_world_size
from foundry.errors import ConfigError, DataError
from foundry.schema import parse_dataclass

log = logging.getLogger(__name__)

RESPONSE_FIELDS = ("chosen", "rejected")


@dataclasses.dataclass
class PreferencePair:
    """One pair's tokens: the shared prompt and each response (ending with eos), already cut to max_seq_len."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


class PreferenceDataLoader:
    """Batches of this rank's pairs, reshuffled each epoch by ``(shuffle_seed, epoch)``; resumable mid-epoch."""

    def __init__(
        self,
        pairs: list[PreferencePair],
        config: PreferenceDatasetConfig,
        device_batch_size: int,
        pad_token_id: int,
        drop_last: bool,
        data_folder: Path | None = None,
    ) -> None:
        self.pairs = pairs
        self.config = config
        self.device_batch_size = device_batch_size
        self.pad_token_id = pad_token_id
        self.drop_last = drop_last
        self.rank, self.world_size = get_rank(), get_world_size()
        self.data_folder = data_folder  # where files about the data (precomputed reference log-probabilities) go
        self.epoch = 0
        self.batch_in_epoch = 0
        self._resume_at: int | None = None
        # A row pair's length is its longer side: packed by the finetuning loader's plan (foundry.data.packing).
        lengths = [len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) for pair in pairs]
        order = self._shuffled(len(pairs), epoch=0)
        rows_per_step = device_batch_size * self.world_size
        ratio = resolve_packing_ratio(config.packing_ratio, lengths, order, rows_per_step, config.max_seq_len)
        self.packed = ratio is not None
        self.rows = pack_rows(lengths, order, ratio, rows_per_step, config.max_seq_len)

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, start = self.epoch, self._resume_at or 0
        self._resume_at = None
        batches = self.epoch_batches(epoch)
        for index in range(start, len(batches)):
            self.batch_in_epoch = index + 1
            yield self.collate(batches[index])
        self.epoch, self.batch_in_epoch = epoch + 1, 0

    def collate(self, rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """The batch of ``rows`` of pair indices, with ``pair_index`` (rows, pairs per row; -1 pads) beside it."""
        batch = collate_pairs([[self.pairs[i] for i in row] for row in rows], self.pad_token_id, self.packed)
        pair_index = torch.full((len(batch["input_ids"]), max(map(len, rows), default=1) or 1), -1)
        for row_index, row in enumerate(rows):
            pair_index[row_index, : len(row)] = torch.tensor(row, dtype=torch.int64)
        return {**batch, "pair_index": pair_index}

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch yielded; after an epoch's last batch, the next epoch's start."""
        if self.batch_in_epoch == len(self.epoch_batches(self.epoch)):
            return {"epoch": self.epoch + 1, "batch_in_epoch": 0}
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._resume_at = self.batch_in_epoch

    def epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        """This rank's batches of ``epoch``: lists of rows of pair indices (an empty row pads a short last step)."""
        rows = [self.rows[index] for index in self._shuffled(len(self.rows), epoch)]
        return rank_batches(rows, self.device_batch_size, self.rank, self.world_size, self.drop_last)

    def _shuffled(self, count: int, epoch: int) -> list[int]:
        if not self.config.shuffle:
            return list(range(count))
        return np.random.default_rng([self.config.shuffle_seed, epoch]).permutation(count).tolist()


def collate_pairs(rows: Sequence[Sequence[PreferencePair]], pad_token_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels``, ``attention_mask`` (and when ``packed``, ``sequence_id`` and ``position_ids``), each
    (rows, 2, seq); an empty row (a short last step) is all padding, labels -100, so it weighs nothing."""
    longest = max([_row_length(row, side) for row in rows for side in (0, 1)], default=1)
    shape = (max(len(rows), 1), 2, max(longest, 1))
    input_ids = torch.full(shape, pad_token_id, dtype=torch.int64)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
    sequence_id = torch.full(shape, -1, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    for index, row in enumerate(rows):
        for side in (0, 1):
            start = 0
            for number, pair in enumerate(row):
                response = pair.rejected if side else pair.chosen
                tokens = np.concatenate([pair.prompt, response])
                end = start + len(tokens)
                input_ids[index, side, start:end] = torch.from_numpy(tokens)
                labels[index, side, start + len(pair.prompt) : end] = torch.from_numpy(response)
                sequence_id[index, side, start:end] = number
                position_ids[index, side, start:end] = torch.arange(len(tokens))
                start = end
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": (sequence_id >= 0).long()}
    return {**batch, "sequence_id": sequence_id, "position_ids": position_ids} if packed else batch


def _row_length(row: Sequence[PreferencePair], side: int) -> int:
    return sum(len(pair.prompt) + len(pair.rejected if side else pair.chosen) for pair in row)


@registry.dataloaders.register("preference")
def build_preference_dataloader(
    *,
    device_batch_size: int,
    dataset: dict[str, Any],
    tokenizer: Any = None,
    drop_last: bool = LOADER_DEFAULTS.drop_last,
    num_workers: int = LOADER_DEFAULTS.num_workers,
    pin_memory: bool = LOADER_DEFAULTS.pin_memory,
    prefetch_factor: int | None = LOADER_DEFAULTS.prefetch_factor,
    persistent_workers: bool = LOADER_DEFAULTS.persistent_workers,
    timeout: float = LOADER_DEFAULTS.timeout,
    key_path: str = "train_loader",
) -> PreferenceDataLoader:
    """Read and tokenize every pair once, refusing a malformed one (naming its row and field) before training.

    The worker keys are accepted as the ``finetuning`` loader accepts them, with no effect.
    """
    check_bounds({"num_workers": num_workers, "prefetch_factor": prefetch_factor, "timeout": timeout}, key_path)
    del num_workers, pin_memory, prefetch_factor, persistent_workers, timeout
    config = parse_dataclass(PreferenceDatasetConfig, dataset, f"{key_path}.dataset")
    _check_config(config, tokenizer, device_batch_size, f"{key_path}.dataset")
    eos_token_id = tokenizer.eos_token_id if config.eos_token_id is None else config.eos_token_id
    render = chat_renderer(tokenizer)
    pairs, truncated = [], 0
    for location, row in _rows(config, f"{key_path}.dataset"):
        try:
            prompt, chosen, rejected = pair_tokens(row, tokenizer, render, eos_token_id)
        except RowFormatError as error:
            raise DataError(f"{location}: {error}. Fix or remove this row.") from None
        pair = _fitted_pair(prompt, chosen, rejected, config.max_seq_len, location, f"{key_path}.dataset")
        truncated += len(pair.chosen) < len(chosen) or len(pair.rejected) < len(rejected)
        pairs.append(pair)
    if not pairs:
        raise DataError(f"'{key_path}.dataset' holds no preference pairs; check its source and split.")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_id
    loader = PreferenceDataLoader(pairs, config, device_batch_size, pad_token_id or 0, drop_last, _data_folder(config))
    log.log(
        logging.WARNING if truncated else logging.INFO,
        "%s: %d pairs, %d with a response cut at max_seq_len %d; batches per epoch on this rank: %d.",
        key_path, len(pairs), truncated, config.max_seq_len, len(loader),
    )  # fmt: skip
    return loader


build_preference_dataloader.check_dataset = check_local_dataset  # type: ignore[attr-defined]


def pair_tokens(row: Any, tokenizer: Any, render: Any, eos_token_id: int | None) -> tuple[list[int], ...]:
    """(prompt, chosen, rejected) token ids of a text or chat row; each response ends with eos."""
    if not isinstance(row, Mapping):
        raise RowFormatError(f"a row must be a JSON object, got {type(row).__name__}")
    missing = [key for key in RESPONSE_FIELDS if key not in row]
    if missing or any(key in row for key in MESSAGES_KEYS):
        raise RowFormatError(
            f"a preference row needs 'chosen' and 'rejected' (and 'prompt' unless both are conversations that "
            f"share it); this one has {sorted(row)}"
        )
    sides = {}
    for key in RESPONSE_FIELDS:
        response = row[key]
        if isinstance(response, list):  # chat: the conversation (after the prompt's messages) ends with the reply
            turns = token_turns({"messages": [*row.get("prompt", []), *response]}, tokenizer, render, eos_token_id)
            context = [token for prompt, reply in turns[:-1] for token in prompt + reply] + turns[-1][0]
            sides[key] = (context, turns[-1][1])
        else:
            turns = token_turns({"prompt": row.get("prompt"), "response": response}, tokenizer, render, eos_token_id)
            sides[key] = turns[0]
        if not sides[key][1]:
            raise RowFormatError(f"'{key}' is empty; a pair compares two non-empty responses")
    (prompt, chosen), (rejected_prompt, rejected) = sides["chosen"], sides["rejected"]
    if prompt != rejected_prompt:
        raise RowFormatError("'chosen' and 'rejected' differ before their last reply; they must share the prompt")
    return prompt, chosen, rejected


def _fitted_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], max_seq_len: int, location: str, key_path: str
) -> PreferencePair:
    """The pair with each response cut to fit ``max_seq_len`` after the prompt; a prompt that leaves no room for
    a response token is refused (cutting it would change what the responses answer)."""
    if len(prompt) >= max_seq_len:
        raise DataError(
            f"{location}: 'prompt' has {len(prompt)} tokens, and '{key_path}.max_seq_len' is {max_seq_len}, which "
            "leaves no room for the responses (a longer pair keeps its prompt and cuts each response at "
            "max_seq_len, but a prompt is never cut). Raise max_seq_len above the prompt, or shorten or remove this "
            "row."
        )
    room = max_seq_len - len(prompt)
    return PreferencePair(*(np.asarray(tokens, dtype=np.int64) for tokens in (prompt, chosen[:room], rejected[:room])))


def _rows(config: PreferenceDatasetConfig, key_path: str) -> Iterator[tuple[str, Any]]:
    """(location for errors, row) of the configured source; ``builtin`` pairs are the quickstart's."""
    if not config.builtin:
        yield from read_rows(config, key_path)
        return
    for index, row in enumerate(builtin_preference_rows()):
        yield f"built-in preference pair {index}", row


def _data_folder(config: PreferenceDatasetConfig) -> Path | None:
    """The local folder that holds the data (a .jsonl file's folder, a jsonl folder, an MDS ``local``), or None."""
    if config.hf_name and config.hf_name != "json":
        path = Path(config.hf_name).expanduser()
        return path if path.is_dir() else path.parent
    return Path(config.local) if config.local else None


def _check_config(config: PreferenceDatasetConfig, tokenizer: Any, device_batch_size: int, key_path: str) -> None:
    check_rows_loader(config, tokenizer, device_batch_size, key_path, "pairs per row pair")
    sources = [name for name in ("hf_name", "local", "streams", "builtin") if getattr(config, name)]
    if len(sources) != 1:
        raise ConfigError(
            f"'{key_path}' needs exactly one data source: 'hf_name' (a local .jsonl file or folder), an MDS "
            f"dataset ('local' / 'remote' or 'streams') or 'builtin: true'; it has {sources or 'none'}."
        )
