"""The job's mesh: built once from ``fsdp_config`` and ``parallelism``, kept on the State, asked by the loop."""

from __future__ import annotations

import pytest

from distributed.jobs import build_trainer
from foundry.core.parallel_dims import ParallelDims
from foundry.distributed.config import ParallelismConfig
from foundry.distributed.mesh import parallel_dims
from foundry.errors import ConfigError


def kept_mesh(folder: str, fsdp_config: dict, parallelism: dict) -> dict:
    trainer = build_trainer(1, folder, fsdp_config, parallelism=parallelism)
    state = trainer.state
    return {
        "dims": state.parallel_dims,
        "axes": dict(zip(state.mesh.world.mesh_dim_names, state.mesh.world.shape)),
        "fsdp": state.mesh.fsdp.mesh_dim_names,
        "loss_group_is_the_world": state.mesh.loss_group is None,
        "samples": state.parallel_dims.sample_ranks,
    }


@pytest.mark.parametrize(
    ("strategy", "cp", "env", "axes"),
    [
        ("FULL_SHARD", 1, None, {"dp_replicate": 1, "dp_shard": 2, "cp": 1}),
        ("FULL_SHARD", 2, None, {"dp_replicate": 1, "dp_shard": 1, "cp": 2}),
        ("HYBRID_SHARD", 1, {"LOCAL_WORLD_SIZE": "1"}, {"dp_replicate": 2, "dp_shard": 1, "cp": 1}),
    ],
    ids=["fsdp", "cp", "hsdp"],
)
def test_the_run_keeps_the_mesh_its_strategy_and_degrees_give(ranks, tmp_path, strategy, cp, env, axes):
    parallelism = {"context_parallel_degree": cp}
    kept = ranks.run(2, kept_mesh, str(tmp_path), {"sharding_strategy": strategy}, parallelism, env=env)[0]
    assert kept["axes"] == axes
    assert kept["dims"] == ParallelDims(**axes)
    assert kept["fsdp"] == (("dp_replicate", "dp_shard") if strategy == "HYBRID_SHARD" else ("dp_shard_cp",))
    assert kept["loss_group_is_the_world"] and kept["samples"] == 2


def test_hybrid_shard_on_one_node_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="HYBRID_SHARD.*one node.*FULL_SHARD.*--nnodes"):
        parallel_dims("hybrid", ParallelismConfig())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two: shard within, replicate across
    assert parallel_dims("hybrid", ParallelismConfig()) == ParallelDims(dp_replicate=2, dp_shard=2)
