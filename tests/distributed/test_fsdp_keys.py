"""Every fsdp_config key either changes what a sharded run does or says, in --help, that it does nothing."""

from __future__ import annotations

import dataclasses

from distributed.jobs import train
from foundry.distributed.config import FSDPConfig

KEYS = {field.name for field in dataclasses.fields(FSDPConfig)}


class ReadTracking(FSDPConfig):
    """An FSDPConfig that records which of its keys the run reads."""

    read: set[str] = set()

    def __getattribute__(self, name: str):
        if name in KEYS:
            ReadTracking.read.add(name)
        return super().__getattribute__(name)


def keys_read_by_a_sharded_run(folder: str) -> set[str]:
    ReadTracking.read = set()
    config = ReadTracking(activation_checkpointing=True, forward_prefetch=True, verbose=True)
    train(1, folder, fsdp_config=config, save_folder=f"{folder}/ckpt", save_interval="1ba")
    return set(ReadTracking.read)


def test_keys_a_sharded_run_never_reads_are_documented_as_doing_nothing(ranks, tmp_path):
    read = ranks.run(2, keys_read_by_a_sharded_run, str(tmp_path))[0]
    docs = {field.name: field.metadata["doc"] for field in dataclasses.fields(FSDPConfig)}
    documented_inert = {key for key, text in docs.items() if text.startswith("no effect")}
    assert KEYS - read == documented_inert
