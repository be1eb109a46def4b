"""Expert parallelism on 2 gloo ranks against one rank's MoE: the same outputs and gradients, the same checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from foundry.distributed.expert_parallel import AllToAllExchange, apply_expert_parallel
from foundry.models.init import InitConfig, init_weights_
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig

D_MODEL = 8


def tiny_moe() -> MoE:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=6, glu=True, act=ActFnConfig("silu"))
    moe = MoE(D_MODEL, config)
    init_weights_(moe, InitConfig(name="baseline_", init_std=0.3), n_layers=2, d_model=D_MODEL)
    return moe


def exchange_matches_one_rank() -> bool:
    rank = dist.get_rank()
    reference = tiny_moe()
    sharded = copy.deepcopy(reference)
    assert apply_expert_parallel([sharded.experts], init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))) == 1
    assert isinstance(sharded.experts.exchange, AllToAllExchange)
    torch.manual_seed(10 + rank)  # each rank routes its own tokens, unevenly (rank 1 has more)
    x = torch.randn(1, 5 + 3 * rank, D_MODEL)
    x_ref = x.clone().requires_grad_(True)
    x = x.requires_grad_(True)
    out, expected = sharded(x), reference(x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sharded.router.layer.weight.grad, reference.router.layer.weight.grad)
    for name in ("up_proj", "gate_proj", "down_proj"):
        full_grad = getattr(reference.experts, name).grad.clone()
        dist.all_reduce(full_grad)  # each rank's tokens reach the experts: their gradients add up
        local = getattr(sharded.experts, name).grad.to_local()
        torch.testing.assert_close(local, full_grad[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-6)
        full_weight = getattr(sharded.experts, name).full_tensor()
        torch.testing.assert_close(full_weight, getattr(reference.experts, name).detach())
    return True


def test_dispatch_and_combine_over_two_ranks_equal_one_rank(ranks) -> None:
    assert ranks.run(2, exchange_matches_one_rank) == [True, True]


def compiled_exchange_keeps_its_graphs(ep_degree_told: int) -> str:
    """The sharded MoE compiled by ``TorchCompile``'s default ``dynamic: auto`` for a run of ``ep_degree_told``,
    ten steps of other token counts (each rank receives other row counts) under dynamo's recompile limit (8 a
    frame): "ok", or "limit hit"."""
    from types import SimpleNamespace

    import torch._dynamo
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from foundry.algorithms import TorchCompile
    from foundry.core.event import Event
    from foundry.core.parallel_dims import ParallelDims

    moe = tiny_moe()
    apply_expert_parallel([moe.experts], init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    torch._dynamo.reset()
    state = SimpleNamespace(model=moe, parallel_dims=ParallelDims(ep=ep_degree_told))
    TorchCompile(backend="aot_eager", scope="model").apply(Event.INIT, state, logger=None)
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        try:
            for step in range(10):
                torch.manual_seed(100 * step + dist.get_rank())
                moe(torch.randn(1, 5 + step + 3 * dist.get_rank(), D_MODEL, requires_grad=True)).sum().backward()
        except FailOnRecompileLimitHit:
            return "limit hit"
    return "ok"


@pytest.mark.slow  # compiling for ten sizes, twice, on two CPU ranks: about 30 s
def test_a_compiled_exchange_compiles_changing_sizes_as_symbols_not_once_per_size(ranks) -> None:
    """Four H200s, 2026-11-28: the 30B MoE with EP4 hit the recompile limit in the exchange (other row counts at
    every step) and ran those frames eagerly from then on. Specialised on each size, it still does."""
    assert ranks.run(2, compiled_exchange_keeps_its_graphs, 2) == ["ok", "ok"]
    assert ranks.run(2, compiled_exchange_keeps_its_graphs, 1) == ["limit hit"] * 2


def compile_dynamic_setting(folder: str, parallelism: dict) -> object:
    """The ``dynamic`` of the compile algorithm a Trainer builds from ``compile_config`` (nothing trained)."""
    from distributed.jobs import build_trainer
    from foundry.algorithms.torch_compile import TorchCompile

    compile_config = {"backend": "eager"}
    trainer = build_trainer(1, folder, FSDP, model_keys=moe_keys(0.0), compile_config=compile_config, **parallelism)
    (algorithm,) = [algorithm for algorithm in trainer.engine.algorithms if isinstance(algorithm, TorchCompile)]
    return algorithm.compile_kwargs["dynamic"]


def test_a_trainer_compiles_changing_sizes_as_symbols_under_expert_parallelism_only(ranks, tmp_path) -> None:
    assert ranks.run(2, compile_dynamic_setting, str(tmp_path / "ep"), EP2) == [None, None]
    assert ranks.run(2, compile_dynamic_setting, str(tmp_path / "fsdp"), {}) == [False, False]


MOE_MODEL = {"expansion_ratio": 1, "ffn_config": {"ffn_type": "mb_dmoe", "moe_num_experts": 4, "moe_top_k": 2}}
FSDP = {"sharding_strategy": "FULL_SHARD"}
EP2 = {"parallelism": {"expert_parallel_degree": 2}}


def moe_keys(loss_weight: float) -> dict:
    return {**MOE_MODEL, "ffn_config": {**MOE_MODEL["ffn_config"], "moe_loss_weight": loss_weight}}


def test_ep2_trains_as_fsdp_alone_with_clipping_and_the_load_balancing_loss(ranks, tmp_path) -> None:
    from distributed.jobs import train
    from foundry.algorithms import GradientClipping

    common = {"model_keys": moe_keys(0.01), "algorithms": [GradientClipping(clipping_threshold=0.05)]}
    fsdp = ranks.run(2, train, 2, str(tmp_path / "fsdp"), FSDP, **common)[0]
    ep = ranks.run(2, train, 2, str(tmp_path / "ep"), FSDP, **EP2, **common)[0]
    assert ep["losses"] == pytest.approx(fsdp["losses"], abs=1e-5)
    for name, weight in fsdp["weights"].items():
        torch.testing.assert_close(ep["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def train_checkpointed(folder: str, parallelism: dict, compiled: bool) -> dict | None:
    """moe-1b-7b.yaml's way on 2 ranks: every block checkpointed, with regional compile (aot_eager) or eager."""
    from distributed.jobs import train, train_compiled

    fsdp_config = {**FSDP, "activation_checkpointing": True}
    if not compiled:
        return train(3, folder, fsdp_config, model_keys=moe_keys(0.01), compile_config=False, **parallelism)
    return train_compiled(3, folder, fsdp_config, model_keys=moe_keys(0.01), compile_config={"backend": "aot_eager"},
                          **parallelism)  # fmt: skip


@pytest.mark.slow  # compiling the expert-parallel blocks on two CPU ranks: about 20 s
def test_ep2_compiles_and_recomputes_checkpointed_blocks_as_fsdp_alone(ranks, tmp_path) -> None:
    """A compiled expert-parallel block once failed to trace (the DTensor weights), and its eager fall-back
    inside a checkpointed block saved tensors twice, which recomputation refused (GPU run, 2026-11-27)."""
    fsdp = ranks.run(2, train_checkpointed, str(tmp_path / "fsdp"), {}, False)[0]
    ep = ranks.run(2, train_checkpointed, str(tmp_path / "ep"), EP2, True)[0]
    assert ep["losses"] == pytest.approx(fsdp["losses"], abs=1e-5)
    for name, weight in fsdp["weights"].items():
        torch.testing.assert_close(ep["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_an_ep2_checkpoint_resumes_on_one_rank(ranks, tmp_path) -> None:
    from distributed.jobs import train
    from foundry.callbacks.hand_over import HandOver

    keys = {"model_keys": moe_keys(0.0)}  # without the per-rank balancing loss, any world size trains alike
    uninterrupted = ranks.run(1, train, 6, str(tmp_path / "one"), None, **keys)[0]
    relaunch = {"callbacks": [HandOver("3ba")], "save_folder": str(tmp_path / "ckpt"), "autoresume": True, **keys}
    first = ranks.run(2, train, 6, str(tmp_path), FSDP, **EP2, **relaunch)[0]
    second = ranks.run(1, train, 6, str(tmp_path), None, **relaunch)[0]
    assert (first["batch"], second["batch"]) == (3, 6)
    for step, loss in second["losses"].items():
        assert loss == pytest.approx(uninterrupted["losses"][step], abs=1e-5), step
    for name, weight in uninterrupted["weights"].items():
        torch.testing.assert_close(second["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_the_deprecated_fsdp_config_key_warns_and_sets_the_parallelism_degree() -> None:
    from foundry.distributed.config import FSDPConfig, ParallelismConfig, with_fsdp_aliases

    with pytest.warns(FutureWarning, match="parallelism: {expert_parallel_degree: 2}"):
        resolved = with_fsdp_aliases(ParallelismConfig(), FSDPConfig(expert_parallel_degree=2))
    assert resolved.expert_parallel_degree == 2


def test_expert_parallelism_with_context_parallelism_is_refused_naming_both_keys() -> None:
    from foundry.distributed.config import ParallelismConfig
    from foundry.distributed.mesh import parallel_dims
    from foundry.errors import ConfigError

    both = ParallelismConfig(expert_parallel_degree=2, context_parallel_degree=2)
    with pytest.raises(ConfigError, match="expert_parallel_degree.*context_parallel_degree"):
        parallel_dims("shard", both)
