"""A 2-rank sharded run saves through an object store (moto's S3 server) and resumes from it on a new machine."""

from __future__ import annotations

import os

import torch

from distributed.jobs import train
from foundry.callbacks.hand_over import HandOver
from foundry.checkpoint.object_store import ObjectStore
from foundry.checkpoint.remote import published_checkpoints, store_checkpoints

NUM_BATCHES = 6
FULL_SHARD = {"sharding_strategy": "FULL_SHARD"}
STORE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


def test_a_sharded_run_saves_to_the_store_from_every_rank_and_resumes_bit_identically(ranks, s3_bucket, tmp_path):
    uninterrupted = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "uninterrupted"), FULL_SHARD)[0]
    url = f"{s3_bucket}/run"
    relaunch = {"callbacks": [HandOver("3ba")], "save_folder": url, "autoresume": True}
    env = {name: os.environ[name] for name in STORE_ENV}
    first = ranks.run(2, train, NUM_BATCHES, str(tmp_path), FULL_SHARD, **relaunch, env={
        **env, "FOUNDRY_CACHE_DIR": str(tmp_path / "machine-1")})[0]  # fmt: skip
    store = ObjectStore(url)
    assert {"__0_0.distcp", "__1_0.distcp", "rng-rank0.json", "rng-rank1.json"} <= set(
        store_checkpoints(store)["ep0-ba3"]
    )
    second = ranks.run(2, train, NUM_BATCHES, str(tmp_path), FULL_SHARD, **relaunch, env={
        **env, "FOUNDRY_CACHE_DIR": str(tmp_path / "machine-2")})[0]  # fmt: skip
    assert (first["batch"], second["batch"]) == (3, NUM_BATCHES)
    assert second["losses"] == {step: uninterrupted["losses"][step] for step in (4, 5, 6)}
    for name, weight in uninterrupted["weights"].items():
        assert torch.equal(second["weights"][name], weight), name
    assert [name for name, _ in published_checkpoints(store)] == ["ep0-ba3", "ep1-ba6"]


def train_on_own_node(cache_root: str, *args, **kwargs) -> dict | None:
    """``train`` as rank r of a job whose ranks run on separate machines: its own disk, local rank 0."""
    from foundry.distributed import get_rank

    os.environ["FOUNDRY_CACHE_DIR"] = f"{cache_root}/node{get_rank()}"
    os.environ["LOCAL_RANK"] = "0"
    return train(*args, **kwargs)


def test_ranks_on_machines_without_a_shared_disk_upload_their_own_files_and_resume(ranks, s3_bucket, tmp_path):
    uninterrupted = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "uninterrupted"), FULL_SHARD)[0]
    url = f"{s3_bucket}/run"
    relaunch = {"callbacks": [HandOver("3ba")], "save_folder": url, "autoresume": True}
    env = {name: os.environ[name] for name in STORE_ENV}
    for machines in ("first-machines", "other-machines"):
        result = ranks.run(2, train_on_own_node, str(tmp_path / machines), NUM_BATCHES, str(tmp_path), FULL_SHARD,
                           **relaunch, env=env)[0]  # fmt: skip
    assert result["batch"] == NUM_BATCHES
    for name, weight in uninterrupted["weights"].items():
        assert torch.equal(result["weights"][name], weight), name
    node1 = tmp_path / "first-machines" / "node1"
    assert not [path for path in node1.rglob("*") if path.is_file()]  # rank 1's share went to the store, not kept
