"""Where finetuning rows come from: local .jsonl files (LLM Foundry's ``hf_name`` forms) or MDS datasets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foundry.data.config import RowsDatasetConfig
from foundry.data.jsonl import read_jsonl
from foundry.data.mds import build_checked_streams, import_streaming
from foundry.data.shm_prefix import elected_shm_prefixes, release_shared_memory
from foundry.errors import ConfigError, DataError

JSON_SUFFIXES = (".jsonl", ".json")


def check_rows_loader(
    config: RowsDatasetConfig, tokenizer: Any, device_batch_size: int, key_path: str, packed: str
) -> None:
    """The checks the ``finetuning`` and ``preference`` loaders share; ``packed``: what ``packing_ratio`` counts."""
    if tokenizer is None:
        raise ConfigError(f"'{key_path}' needs a tokenizer: set the run's tokenizer section.")
    if device_batch_size < 1:
        raise ConfigError(f"The batch size of '{key_path}' is {device_batch_size}; it must be at least 1.")
    ratio = config.packing_ratio
    if ratio is not None and ratio != "auto" and (isinstance(ratio, str) or ratio < 1):
        raise ConfigError(f"'{key_path}.packing_ratio' is {ratio!r}; use a number >= 1 ({packed}), 'auto' or null.")


def read_rows(config: RowsDatasetConfig, key_path: str) -> Iterator[tuple[str, Any]]:
    """(location for errors, row) for every row of the configured source."""
    if config.hf_name is not None:
        for path in _jsonl_files(config, key_path):
            yield from _read_jsonl(path)
    else:
        yield from _read_mds(config, key_path)


def _jsonl_files(config: RowsDatasetConfig, key_path: str) -> list[Path]:
    """The files ``hf_name`` names: a .jsonl file, a folder's ``<split>.jsonl`` / ``<split>/*.jsonl``, or 'json'."""
    name, split = config.hf_name, config.split
    if name == "json":  # LLM Foundry's local form: hf_name json + hf_kwargs data_files or data_dir
        data_files = config.hf_kwargs.get("data_files")
        if isinstance(data_files, dict):
            data_files = data_files.get(split)
        if data_files:
            return [Path(path) for path in ([data_files] if isinstance(data_files, str) else data_files)]
        data_dir = config.hf_kwargs.get("data_dir")
        if not data_dir:
            raise ConfigError(f"'{key_path}.hf_name' is 'json'; set '{key_path}.hf_kwargs.data_files' or 'data_dir'.")
        name = data_dir
    path = Path(name).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [path / f"{split}{suffix}" for suffix in JSON_SUFFIXES if (path / f"{split}{suffix}").is_file()]
        files = files or sorted(f for f in (path / str(split)).glob("*.json*") if f.suffix in JSON_SUFFIXES)
        if files:
            return files
        raise DataError(
            f"'{key_path}' points at the folder {path}, which has no {split}.jsonl and no {split}/*.jsonl for "
            f"split '{split}'. Set '{key_path}.split' to the file's name, or hf_name to the file itself."
        )
    if name.endswith(JSON_SUFFIXES) or name.startswith(("/", ".", "~")):
        raise DataError(f"'{key_path}.hf_name' is {name!r}, but no such file or folder exists.")
    raise ConfigError(
        f"'{key_path}.hf_name' is {name!r}, a Hugging Face Hub dataset. foundry finetunes from local data: export "
        f"it once where the Hub is reachable, e.g. python -c \"import datasets; datasets.load_dataset('{name}', "
        f"split='{split}').to_json('{split}.jsonl')\", then set hf_name to that .jsonl file (or convert it to MDS)."
    )


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise DataError(f"Finetuning data file {path} does not exist.")
    yield from read_jsonl(path, 'such as {"prompt": "...", "response": "..."}')


def _read_mds(config: RowsDatasetConfig, key_path: str) -> Iterator[tuple[str, Any]]:
    dataset_class = import_streaming(f"The finetuning dataloader '{key_path}'").StreamingDataset
    streams = build_checked_streams(config, key_path)
    streaming_keys = ("download_retry", "download_timeout", "validate_hash", "keep_zip", "predownload", "cache_limit")
    kwargs = {key: getattr(config, key) for key in streaming_keys if getattr(config, key) is not None}
    with elected_shm_prefixes():  # jobs on one host keep apart (foundry/data/shm_prefix.py)
        dataset = dataset_class(
            streams=streams, local=None if streams else config.local, remote=config.remote, split=config.split, **kwargs
        )
    try:
        for index in range(dataset.num_samples):
            yield f"{config.local or 'streams'} (split '{config.split}') sample {index}", dict(dataset[index])
    finally:
        release_shared_memory(dataset)
