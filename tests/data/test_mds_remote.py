"""MDS data on an object store (``dataset.remote: s3://...``) streams into a local cache, as in LLM Foundry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from streaming import MDSWriter

SEQ = 8


def test_mds_data_on_s3_streams_through_a_local_cache(s3_bucket: str, tmp_path: Path, make_loader) -> None:
    remote = f"{s3_bucket}/data"
    # Written by streaming's own writer, which uploads each shard (as LLM Foundry's converters do).
    with MDSWriter(out=f"{remote}/train", columns={"tokens": "ndarray:int32"}, size_limit=256) as writer:
        for i in range(6):
            writer.write({"tokens": np.arange(i * SEQ, (i + 1) * SEQ, dtype=np.int32)})
    cache = tmp_path / "mds-cache"
    dataset = {"remote": remote, "local": str(cache), "split": "train", "max_seq_len": SEQ, "shuffle": False}
    batches = list(make_loader(dataset=dataset, device_batch_size=2))
    assert torch.equal(torch.cat([batch["input_ids"] for batch in batches]).flatten(), torch.arange(6 * SEQ))
    assert len(list((cache / "train").glob("shard.*.mds"))) > 1  # several shards, each downloaded
