"""The ``finetuning`` dataloader: prompt/response or chat rows, response-only labels, optional packing.

LLM Foundry's ``train_loader.name: finetuning`` keys. Rows come from a local ``.jsonl`` file (or a
folder of them per split, or LLM Foundry's ``hf_name: json`` form) or from an MDS dataset
(``local``/``remote``/``streams``, columns ``prompt``/``response``, ``messages`` or pre-tokenized
``turns``). Every row is tokenized once when the loader is built; then::

    from foundry.data import build_finetuning_dataloader, load_tokenizer

    loader = build_finetuning_dataloader(
        tokenizer=load_tokenizer("data/quickstart/tokenizer"),
        device_batch_size=8,
        dataset={"hf_name": "data/instructions/train.jsonl", "max_seq_len": 128, "packing_ratio": 3},
    )
    loader.counts  # rows read, kept, truncated and dropped (and why)
    batch = next(iter(loader))  # input_ids, labels (-100 off target), attention_mask, sequence_id, position_ids
    state = loader.state_dict()  # a fresh loader given load_state_dict(state) resumes after the last batch

See docs/FINETUNING.md for the keys, the labels, truncation and packing.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from foundry import registry
from foundry.core.bounds import check_bounds
from foundry.data.chat import RowFormatError, chat_renderer
from foundry.data.config import LOADER_DEFAULTS, FinetuningDatasetConfig
from foundry.data.finetuning_examples import FinetuningCounts, LabelPolicy, build_example, token_turns
from foundry.data.finetuning_rows import check_rows_loader, read_rows
from foundry.data.packing import Row, collate_packed_rows, pack_rows, rank_batches, resolve_packing_ratio
from foundry.distributed.env import get_rank, get_world_size
from foundry.errors import ConfigError, DataError
from foundry.schema import parse_dataclass

log = logging.getLogger(__name__)


class FinetuningDataLoader:
    """Batches of this rank's share of each step, packed or one example per row; resumable mid-epoch.

    Examples are tokenized once at build and packed once into rows (in an order shuffled by
    ``(shuffle_seed, 0)``); each epoch permutes the rows with ``(shuffle_seed, epoch)`` and deals
    them out by rank. Every epoch thus has the same number of batches (exact schedules in epochs),
    and a checkpoint's ``{"epoch", "batch_in_epoch"}`` restores the position exactly.
    """

    def __init__(
        self,
        examples: list[tuple[np.ndarray, np.ndarray]],
        config: FinetuningDatasetConfig,
        counts: FinetuningCounts,
        device_batch_size: int,
        pad_token_id: int,
        drop_last: bool,
        replication: int = 1,
    ) -> None:
        self.input_ids = [input_ids for input_ids, _ in examples]
        self.labels = [labels for _, labels in examples]
        self.config = config
        self.counts = counts
        self.device_batch_size = device_batch_size
        self.pad_token_id = pad_token_id
        self.drop_last = drop_last
        # ``replication`` consecutive ranks (tensor-parallel ones) load the same rows
        self.rank, self.world_size = get_rank() // replication, get_world_size() // replication
        self.epoch = 0
        self.batch_in_epoch = 0
        self._resume_at: int | None = None
        lengths = [len(input_ids) for input_ids in self.input_ids]
        example_order = self._shuffled(len(lengths), epoch=0)
        rows_per_step = device_batch_size * self.world_size
        self.packing_ratio = resolve_packing_ratio(
            config.packing_ratio, lengths, example_order, rows_per_step, config.max_seq_len
        )
        self.rows = pack_rows(lengths, example_order, self.packing_ratio, rows_per_step, config.max_seq_len)

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, start = self.epoch, self._resume_at or 0
        self._resume_at = None
        batches = self.epoch_batches(epoch)
        for index in range(start, len(batches)):
            self.batch_in_epoch = index + 1
            yield self._collate(batches[index])
        self.epoch, self.batch_in_epoch = epoch + 1, 0  # a finished epoch resumes at the next one

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch yielded; after an epoch's last batch, the next epoch's start."""
        if self.batch_in_epoch == len(self.epoch_batches(self.epoch)):  # even if the iteration was not finished
            return {"epoch": self.epoch + 1, "batch_in_epoch": 0}
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._resume_at = self.batch_in_epoch

    def epoch_batches(self, epoch: int) -> list[list[Row]]:
        """This rank's batches of ``epoch``, each a list of rows of example indices."""
        rows = [self.rows[index] for index in self._shuffled(len(self.rows), epoch)]
        return rank_batches(rows, self.device_batch_size, self.rank, self.world_size, self.drop_last)

    def _shuffled(self, count: int, epoch: int) -> list[int]:
        """``range(count)``, permuted by ``(shuffle_seed, epoch)`` when shuffling."""
        if not self.config.shuffle:
            return list(range(count))
        return np.random.default_rng([self.config.shuffle_seed, epoch]).permutation(count).tolist()

    def packing_summary(self) -> str:
        """Rows, examples per row and the share of padding tokens (to tune packing_ratio)."""
        tokens = sum(len(self.input_ids[index]) for row in self.rows for index in row)
        padding = 1 - tokens / (len(self.rows) * self.config.max_seq_len)
        ratio = "" if self.config.packing_ratio != "auto" else f"packing_ratio auto chose {self.packing_ratio or 1}; "
        return ratio + (
            f"{len(self.rows)} rows of {len(self.input_ids) / len(self.rows):.2f} examples on average, "
            f"{padding:.1%} padding; batches per epoch on this rank: {len(self)}"
        )

    def _collate(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        trim = 8 if self.config.allow_pad_trimming else None
        return collate_packed_rows(rows, self.input_ids, self.labels, self.config.max_seq_len, self.pad_token_id, trim)


@registry.dataloaders.register("finetuning")
def build_finetuning_dataloader(
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
    replication: int = 1,
) -> FinetuningDataLoader:
    """Build LLM Foundry's ``finetuning`` loader; rows are read and tokenized here, once.

    The worker keys (``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
    ``timeout``) are accepted for LLM Foundry YAMLs and have no effect: batches are slices of
    already-tokenized examples, assembled in the training process. ``replication``: how many consecutive ranks
    load the same rows (tensor parallelism).
    """
    check_bounds({"num_workers": num_workers, "prefetch_factor": prefetch_factor, "timeout": timeout}, key_path)
    del num_workers, pin_memory, prefetch_factor, persistent_workers, timeout
    config = parse_dataclass(FinetuningDatasetConfig, dataset, f"{key_path}.dataset")
    _check_config(config, tokenizer, device_batch_size, f"{key_path}.dataset")
    policy = LabelPolicy(config.target_prompts, config.target_responses)
    eos_token_id = tokenizer.eos_token_id if config.eos_token_id is None else config.eos_token_id
    preprocess = _preprocessing_fn(config.preprocessing_fn, f"{key_path}.dataset.preprocessing_fn")
    render = chat_renderer(tokenizer)
    counts = FinetuningCounts()
    examples = []
    for location, row in read_rows(config, f"{key_path}.dataset"):
        counts.rows += 1
        try:
            row = preprocess(row) if preprocess else row
            turns = token_turns(row, tokenizer, render, eos_token_id, config.token_encoding_type)
        except RowFormatError as error:
            raise DataError(f"{location}: {error}. Fix or remove this row.") from None
        example = build_example(turns, policy, config.max_seq_len, config.truncation, counts)
        if example is not None:
            examples.append(example)
    if not examples:
        raise DataError(
            f"'{key_path}.dataset' yields no examples to train on ({counts}). Check the split, max_seq_len "
            f"and target_prompts/target_responses."
        )
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_id
    loader = FinetuningDataLoader(
        examples, config, counts, device_batch_size, pad_token_id or 0, drop_last, replication
    )
    log_level = logging.WARNING if counts.kept < counts.rows or counts.truncated else logging.INFO
    log.log(log_level, "%s: %s; %s.", key_path, counts, loader.packing_summary())
    return loader


def _check_config(config: FinetuningDatasetConfig, tokenizer: Any, device_batch_size: int, key_path: str) -> None:
    check_rows_loader(config, tokenizer, device_batch_size, key_path, "examples per row")
    if not config.decoder_only_format:
        raise ConfigError(
            f"'{key_path}.decoder_only_format: false' formats data for encoder-decoder models (T5, LLM Foundry's "
            "model.name hf_t5), which foundry does not train: it trains decoder-only language models "
            "(docs/LLM_FOUNDRY.md). Finetune one (hf_causal_lm, mpt_causal_lm, llama_causal_lm) with true."
        )
    prompts = config.target_prompts
    valid_length = prompts.startswith("length>=") and prompts.removeprefix("length>=").isdigit()
    if prompts not in ("none", "all") and not (valid_length and int(prompts.removeprefix("length>=")) > 0):
        raise ConfigError(f"'{key_path}.target_prompts' is {prompts!r}; use 'none', 'all' or 'length>=N' (N > 0).")
    sources = [name for name in ("hf_name", "local", "streams") if getattr(config, name)]
    if len(sources) != 1:
        raise ConfigError(
            f"'{key_path}' needs exactly one data source: 'hf_name' (a local .jsonl file or folder) or an MDS "
            f"dataset ('local' / 'remote' or 'streams'); it has {sources or 'none'}."
        )


def _preprocessing_fn(spec: str | dict[str, str] | None, key_path: str) -> Callable[[Any], Any] | None:
    """LLM Foundry's preprocessing_fn: an import path 'module:function' or a {prompt, response} column map."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        if set(spec) != {"prompt", "response"}:
            raise ConfigError(f"'{key_path}' maps columns with exactly the keys prompt and response: {sorted(spec)}.")
        return lambda row: {target: row.get(column) for target, column in spec.items()}
    module_name, _, function_name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as error:
        message = f"'{key_path}' is {spec!r}, which cannot be imported ({error}); use 'module:function'."
        raise ConfigError(message) from None
