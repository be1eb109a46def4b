"""MDS datasets through mosaicml-streaming, which is imported only here and only when a loader reads one.

The GPU image ships without mosaicml-streaming, so ``import foundry.data`` must not need it: the
``text`` loader, MDS finetuning sources and ``foundry data convert`` call ``import_streaming`` first
and fail with the install command; jsonl finetuning data, evaluation and custom loaders never do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from foundry.errors import ConfigError, DataError
from foundry.optional import import_optional
from foundry.schema import check_call_kwargs

if TYPE_CHECKING:
    from streaming import Stream, StreamingDataset


def import_streaming(needed_for: str) -> ModuleType:
    """The ``streaming`` module, or a FoundryError saying that ``needed_for`` needs it and how to install it."""
    return import_optional(
        "streaming",
        needed_for=f"{needed_for} (MDS data)",
        package="the mosaicml-streaming package",
        install="pip install mosaicml-streaming",
    )


def build_checked_streams(config: Any, key_path: str) -> list[Stream] | None:
    """``config.streams`` as Streams (None without), each local-only one checked to exist on disk.

    ``config`` has the dataset keys ``streams``, ``local``, ``remote`` and ``split``; ``key_path`` names it.
    """
    streams = _build_streams(config, key_path)
    for local, remote, split in _stream_locations(config):
        _check_local_split(local, remote, split, key_path)
    return streams


def check_local_dataset(dataset: Mapping[str, Any], key_path: str) -> None:
    """A loader's ``dataset`` section (``key_path``) that reads a local MDS folder without a remote: the folder
    must exist. Cheap, so ``foundry train`` runs it before loading the tokenizer that may live beside the data."""
    if "local" not in dataset and not dataset.get("streams"):
        return
    config = SimpleNamespace(
        streams=dataset.get("streams"),
        local=dataset.get("local"),
        remote=dataset.get("remote") or None,
        split=dataset.get("split"),
    )
    for local, remote, split in _stream_locations(config):
        _check_local_split(local, remote, split, key_path)


def _build_streams(config: Any, key_path: str) -> list[Stream] | None:
    if not config.streams:
        return None
    stream_class = import_streaming(f"'{key_path}.streams'").Stream
    return [
        stream_class(**check_call_kwargs(stream_class, kwargs, f"{key_path}.streams.{name}"))
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
            f"No dataset at '{local}' ('{key_path}.local', split '{split}'): the folder does not exist and "
            f"'{key_path}.remote' is empty. If the data is elsewhere, point '{key_path}.local' at it (in a YAML "
            f"that sets it through variables, e.g. variables.data_local); to create it, run 'foundry data convert "
            f"<files> --out {local} --concat-tokens <max_seq_len>'; or set '{key_path}.remote' to where the "
            "dataset is stored."
        )
    if not (split_dir / "index.json").is_file():
        splits = sorted(child.name for child in root.iterdir() if (child / "index.json").is_file())
        raise DataError(
            f"No MDS dataset (index.json) at '{split_dir}' for split '{split}'. "
            f"Splits in '{local}': {', '.join(splits) or 'none'}. Set '{key_path}.split' to one of them, "
            f"or re-create the dataset with 'foundry data convert ... --out {local}'."
        )
    check_shard_files(split_dir, local)


def rebuild_hint(local: str) -> str:
    return (
        f"Rebuild the dataset with 'foundry data convert <your inputs> --out {local} --overwrite' (the arguments "
        "that made it), or restore the folder from a copy."
    )


def check_shard_files(split_dir: Path, local: str) -> None:
    """Every shard that ``index.json`` lists is on disk at the size it was written (a few ``stat`` calls)."""
    index_file = split_dir / "index.json"
    try:
        shards = json.loads(index_file.read_bytes())["shards"]
        files = [[info for info in (shard["raw_data"], shard.get("zip_data")) if info] for shard in shards]
        expected = [[(info["basename"], info["bytes"]) for info in pair] for pair in files]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise DataError(
            f"{index_file} is damaged ({type(exc).__name__}: {exc}), so the dataset's shards cannot be found. "
            f"{rebuild_hint(local)}"
        ) from None
    for pair in expected:
        present = [(name, size) for name, size in pair if (split_dir / name).is_file()]
        if not present:
            raise DataError(
                f"Shard {split_dir / pair[0][0]}, listed in {index_file}, is missing. {rebuild_hint(local)}"
            )
        for name, size in present:
            found = (split_dir / name).stat().st_size
            if found != size:
                raise DataError(
                    f"Shard {split_dir / name} has {found} bytes where {index_file} says {size}: it is truncated or "
                    f"damaged. {rebuild_hint(local)}"
                )


def shard_of_sample(dataset: StreamingDataset, sample_index: int) -> tuple[Path, Any, str]:
    """(the local file, its streaming ``FileInfo``, the stream's ``local``) of the shard holding a sample.

    Reads streaming's ``spanner``, ``shards`` and ``stream_per_shard``: internals, so that errors can
    name the file.
    """
    shard_id = int(dataset.spanner[sample_index][0])
    stream = dataset.streams[int(dataset.stream_per_shard[shard_id])]
    info = dataset.shards[shard_id].raw_data
    return Path(stream.local, stream.split or "", info.basename), info, str(stream.local)


def shard_damage(path: Path, info: Any) -> str | None:
    """What is wrong with a shard file (its size, or a checksum that index.json records), or None."""
    from streaming.base.hashing import get_hash, is_hash

    if not path.is_file():
        return "it is missing"
    if path.stat().st_size != info.bytes:
        return f"it has {path.stat().st_size} bytes where index.json says {info.bytes}"
    for algorithm, digest in (info.hashes or {}).items():
        if is_hash(algorithm):
            if get_hash(algorithm, path.read_bytes()) != digest:
                return f"its {algorithm} checksum differs from the one index.json records (its contents were altered)"
            break
    return None
