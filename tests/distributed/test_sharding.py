"""Every sharding strategy on 2 ranks trains exactly like one process with the same global batch."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import assert_same_run, collective_counts, initial_weights, train, train_compiled
from foundry.algorithms import TorchCompile

NUM_BATCHES = 5
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD"]


@pytest.fixture(scope="session")  # not rerun when a shuffled order leaves this module and comes back
def one_rank(ranks, tmp_path_factory) -> dict:
    """The reference: the plain module (no fsdp_config) in one process."""
    return ranks.run(1, train, NUM_BATCHES, str(tmp_path_factory.mktemp("one_rank")))[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_match_one_rank(ranks, one_rank, strategy, tmp_path):
    # the hybrid strategies with one rank per node: replicate across the 2 "nodes" (on one node they are refused)
    env = {"LOCAL_WORLD_SIZE": "1"} if "HYBRID" in strategy else None
    result = ranks.run(2, train, NUM_BATCHES, str(tmp_path), {"sharding_strategy": strategy}, env=env)[0]
    assert_same_run(result, one_rank)


def test_fsdp_on_one_rank_matches_the_plain_module(ranks, one_rank, tmp_path):
    assert_same_run(ranks.run(1, train, NUM_BATCHES, str(tmp_path), {})[0], one_rank)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_the_losses(ranks, one_rank, reentrant, tmp_path):
    fsdp = {"activation_checkpointing": True, "activation_checkpointing_reentrant": reentrant}
    assert_same_run(ranks.run(2, train, NUM_BATCHES, str(tmp_path), fsdp)[0], one_rank)


@pytest.mark.parametrize("init_device", ["meta", "mixed"])
def test_sharded_meta_init_gives_the_unsharded_weights(ranks, init_device, tmp_path):
    unsharded = ranks.run(1, initial_weights, str(tmp_path / "cpu"))[0]
    keys = {"init_device": init_device}
    sharded = ranks.run(2, initial_weights, str(tmp_path / init_device), {}, model_keys=keys)[0]
    for name, weight in unsharded.items():
        assert torch.equal(sharded[name], weight), name


def test_two_ranks_without_fsdp_config_replicate_the_model(ranks, one_rank, tmp_path):
    assert_same_run(ranks.run(2, train, NUM_BATCHES, str(tmp_path), None)[0], one_rank)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_gradient_accumulation_over_microbatches_matches_one_rank(ranks, one_rank, strategy, tmp_path):
    fsdp = {"sharding_strategy": strategy}
    result = ranks.run(2, train, NUM_BATCHES, str(tmp_path), fsdp, device_train_microbatch_size=1)[0]
    assert_same_run(result, one_rank)


@pytest.mark.parametrize(
    "keys",
    [
        {"reduce_every_microbatch": True},
        {"reshard_between_microbatches": False},
        {"reshard_between_microbatches": False, "sharding_strategy": "SHARD_GRAD_OP"},
        {"reduce_every_microbatch": True, "reshard_between_microbatches": False},
    ],
    ids=["reduce-every-microbatch", "keep-gathered", "keep-gathered-zero2", "both"],
)
def test_microbatch_schedules_match_one_rank(ranks, one_rank, keys, tmp_path):
    result = ranks.run(2, train, NUM_BATCHES, str(tmp_path), keys, device_train_microbatch_size=1)[0]
    assert_same_run(result, one_rank)


def test_microbatch_schedules_change_the_collectives(ranks, tmp_path):
    """Two microbatches a rank, 3 FSDP modules (2 blocks, the root): what each schedule sends in a batch."""

    def counts(**keys) -> dict[str, int]:
        return ranks.run(2, collective_counts, str(tmp_path / str(sorted(keys.items()))), keys, 1)[0]

    fsdp2 = counts(reshard_between_microbatches=True, reduce_every_microbatch=False)
    # Per microbatch: the 3 modules in forward, the first block again in backward (the last block and the root
    # stay gathered for it); gradients reduced once a module, after the last microbatch.
    assert fsdp2 == {"all_gather": 8, "reduce_scatter": 3}
    assert counts(reshard_between_microbatches=True, reduce_every_microbatch=True)["reduce_scatter"] == 6
    # Each module gathered once a batch, at its first forward
    assert counts(reshard_between_microbatches=False, reduce_every_microbatch=False)["all_gather"] == 3
    assert counts() == {"all_gather": 3, "reduce_scatter": 3}  # auto: a tiny model on the CPU keeps both


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_model_under_fsdp_keeps_the_losses(ranks, one_rank, scope, tmp_path):
    compile_ = TorchCompile(backend="aot_eager", scope=scope)
    assert_same_run(ranks.run(2, train_compiled, NUM_BATCHES, str(tmp_path), {}, algorithms=[compile_])[0], one_rank)


def test_compiled_model_with_the_fused_loss_under_full_shard_keeps_the_losses(ranks, one_rank, tmp_path):
    """What compile_config and loss_fn: auto give a sharded GPU run: block compile and the fused loss, on 2 ranks."""
    compile_ = TorchCompile(backend="aot_eager", scope="blocks", compile_loss=True)
    fused = {"loss_fn": "fused_crossentropy"}
    result = ranks.run(2, train_compiled, NUM_BATCHES, str(tmp_path), {}, algorithms=[compile_], model_keys=fused)[0]
    assert_same_run(result, one_rank)


@pytest.mark.parametrize("fsdp_config", [{}, None], ids=["fsdp_config", "plain"])
def test_one_rank_meta_init_gets_the_weights_of_a_cpu_init(ranks, fsdp_config, tmp_path):
    """With or without fsdp_config: the same seed gives the same weights on any device and world size."""
    unsharded = ranks.run(1, initial_weights, str(tmp_path / "cpu"))[0]
    keys = {"init_device": "meta"}
    one_rank = ranks.run(1, initial_weights, str(tmp_path / "meta"), fsdp_config, model_keys=keys)[0]
    for name, weight in unsharded.items():
        assert torch.equal(one_rank[name], weight), name
