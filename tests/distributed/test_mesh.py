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
        ("FULL_SHARD", 1, None, {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}),
        ("FULL_SHARD", 2, None, {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}),
        ("HYBRID_SHARD", 1, {"LOCAL_WORLD_SIZE": "1"}, {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}),
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


def test_tensor_parallel_ranks_form_the_innermost_axis_and_share_samples_and_loss(ranks, tmp_path):
    kept = ranks.run(2, kept_mesh, str(tmp_path), {"sharding_strategy": "FULL_SHARD"}, {"tensor_parallel_degree": 2})[0]
    assert kept["axes"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert kept["fsdp"] == ("dp_shard_cp",)
    # both ranks hold the same loss and load the same samples: no reduction over tp
    assert not kept["loss_group_is_the_world"] and kept["samples"] == 1


def test_tensor_parallel_degree_divides_the_data_parallel_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    dims = parallel_dims("shard", ParallelismConfig(tensor_parallel_degree=2))
    assert dims == ParallelDims(dp_shard=4, tp=2)
    assert (dims.world_size, dims.sample_ranks, dims.loss_ranks) == (8, 4, 4)
    assert [dims.sample_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes: tp within each
    assert parallel_dims("hybrid", ParallelismConfig(tensor_parallel_degree=2)) == ParallelDims(2, 2, 1, tp=2)
    with pytest.raises(ConfigError, match="'parallelism.tensor_parallel_degree' is 3, which does not divide the 8"):
        parallel_dims("shard", ParallelismConfig(tensor_parallel_degree=3))


def test_hybrid_shard_on_one_node_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="HYBRID_SHARD.*one node.*FULL_SHARD.*--nnodes"):
        parallel_dims("hybrid", ParallelismConfig())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two: shard within, replicate across
    assert parallel_dims("hybrid", ParallelismConfig()) == ParallelDims(dp_replicate=2, dp_shard=2)
