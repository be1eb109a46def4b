"""The pure parts of sharding: dtypes, which blocks are sharded, which modules are checkpointed."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyLM
from torch import nn

from foundry.distributed import fsdp
from foundry.distributed.activation_checkpoint import block_ids, checkpoint_plan
from foundry.distributed.config import FSDPConfig
from foundry.distributed.fsdp import (
    GradientAccumulation,
    mixed_precision_policy,
    model_is_small_for,
)
from foundry.distributed.placement import prepare_sharding
from foundry.distributed.process_group import init_process_group
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError
from foundry.models import MPTCausalLM

TINY = {"d_model": 16, "n_heads": 2, "n_layers": 4, "vocab_size": 32, "max_seq_len": 8}


@pytest.mark.parametrize(
    ("mode", "precision", "param_dtype", "reduce_dtype"),
    [
        ("PURE", "amp_bf16", torch.bfloat16, torch.bfloat16),
        ("DEFAULT", "amp_bf16", torch.bfloat16, torch.float32),
        ("DEFAULT", "amp_fp16", torch.float16, torch.float32),
        ("FULL", "amp_bf16", None, None),
        ("PURE", "fp32", None, None),
    ],
)
def test_mixed_precision_maps_as_llm_foundry(mode, precision, param_dtype, reduce_dtype):
    policy = mixed_precision_policy(mode, precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_a_model_is_small_when_two_bf16_copies_fit_a_quarter_of_the_device():
    model = nn.Linear(1000, 1000, bias=False)  # 1e6 parameters: two bf16 copies are 4e6 bytes
    assert model_is_small_for(model, None, memory_bytes=16_000_000)
    assert not model_is_small_for(model, None, memory_bytes=15_999_999)
    assert model_is_small_for(model, torch.device("cpu"))  # host memory: no device limit to respect


@pytest.mark.parametrize("small", [True, False])
def test_auto_schedule_holds_whole_copies_only_for_small_models(monkeypatch, small):
    monkeypatch.setattr(fsdp, "model_is_small_for", lambda model, device: small)
    auto = GradientAccumulation(nn.Linear(2, 2), [], FSDPConfig())  # type: ignore[arg-type]
    assert (auto.keep_gathered, auto.reduce_every_microbatch) == (small, not small)
    keys = FSDPConfig(reduce_every_microbatch=small, reshard_between_microbatches=small)
    chosen = GradientAccumulation(nn.Linear(2, 2), [], keys)  # type: ignore[arg-type]
    assert (chosen.keep_gathered, chosen.reduce_every_microbatch) == (not small, small)


def test_mpt_blocks_are_sharded_one_by_one():
    model = MPTCausalLM(**TINY)
    assert blocks_of(model) == list(model.transformer.blocks)


def test_a_model_names_its_blocks_with_parallel_blocks():
    class TwoStages(TinyLM):
        def parallel_blocks(self) -> list[nn.Module]:
            return [self.embed]

    model = TwoStages()
    assert blocks_of(model) == [model.embed]


def test_hugging_face_blocks_come_from_no_split_modules():
    class Layer(nn.Linear):
        pass

    class HFLike(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(2, 2), Layer(2, 2)])
            self.head = nn.Linear(2, 2)

    model = HFLike()
    assert blocks_of(model) == list(model.layers)


@pytest.mark.parametrize(
    ("selection", "ids"),
    [(-1, [0, 1, 2, 3, 4, 5]), (2, [0, 1]), ("last-2", [4, 5]), ("middle-2", [1, 2]),
     ("range-1-3", [1, 2]), ("first-1, last-1", [0, 5]), ([0, "last-1", 9], [0, 5])],
)  # fmt: skip
def test_block_selection_reads_llm_foundry_forms(selection, ids):
    assert block_ids(selection, num_blocks=6) == ids


def test_default_target_checkpoints_every_whole_block():
    blocks = list(MPTCausalLM(**TINY).transformer.blocks)
    assert checkpoint_plan(blocks, None) == [[block] for block in blocks]


def test_target_names_submodules_in_chosen_blocks():
    blocks = list(MPTCausalLM(**TINY).transformer.blocks)
    plan = checkpoint_plan(blocks, {"grouped_query_attention": "last-1", "mptblock": [0]})
    assert plan == [[blocks[0]], [], [], [blocks[3].attn]]


def test_unknown_target_lists_the_modules_there_are():
    blocks = list(MPTCausalLM(**TINY).transformer.blocks)
    with pytest.raises(ConfigError, match="attention, .*mptblock"):
        checkpoint_plan(blocks, ["flash_block"])


def test_sharding_rejects_an_optimizer_built_before_the_model_is_sharded():
    model = TinyLM()
    with pytest.raises(ConfigError, match="Pass a function"):
        prepare_sharding({}, torch.optim.SGD(model.parameters(), lr=0.1))


def test_one_process_without_fsdp_config_is_not_sharded():
    assert prepare_sharding(None, None) is None


def test_several_ranks_without_a_rendezvous_address_fail_clearly(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="--nproc"):
        init_process_group()


def checkpointed_modules(model_section: dict, folder: str) -> list[str]:
    """Names of the modules that a 1-rank Trainer wrapped for activation checkpointing (run on a rank)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from foundry.models.build import build_model
    from foundry.trainer import Trainer

    trainer = Trainer(
        model=build_model(model_section),
        train_dataloader=[],
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        fsdp_config={"activation_checkpointing": True},
        device="cpu",
        run_folder=folder,
        log_to_console=False,
    )
    modules = trainer.state.model.named_modules()
    return [name.replace("._checkpoint_wrapped_module", "") for name, m in modules if isinstance(m, CheckpointWrapper)]


@pytest.mark.parametrize("family", ["mpt_causal_lm", "llama_causal_lm"])
def test_activation_checkpointing_target_key_reaches_the_sharded_model(ranks, family, tmp_path):
    keys = {**TINY, "kv_n_heads": 2} if family == "llama_causal_lm" else dict(TINY)
    if family == "llama_causal_lm":
        keys.update(multiple_of=8)
    section = {"name": family, **keys, "activation_checkpointing_target": {"grouped_query_attention": "last-1"}}
    assert ranks.run(1, checkpointed_modules, section, str(tmp_path))[0] == ["transformer.blocks.3.attn"]


def placement(fsdp_config: dict, precision: str, folder: str, model_section: dict | None = None) -> dict | None:
    """How a Trainer placed the model (run on each rank): sharded or not, and the residual stream's dtype."""
    from torch.distributed.fsdp import FSDPModule

    from foundry.core.precision import autocast
    from foundry.distributed import get_rank
    from foundry.models.build import build_model
    from foundry.trainer import Trainer

    trainer = Trainer(
        model=build_model(model_section or {"name": "mpt_causal_lm", **TINY}),
        train_dataloader=[],
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        fsdp_config=fsdp_config,
        precision=precision,
        device="cpu",
        run_folder=folder,
        log_to_console=False,
    )
    model = trainer.state.model
    # Weight gradients summed inside the GEMM only where autograd owns them: not under FSDP2.
    linears = sorted({type(module).__name__ for module in model.modules() if isinstance(module, torch.nn.Linear)})
    if isinstance(model, FSDPModule):  # its embedding runs only inside the root's forward
        return {"sharded": True, "linears": linears} if get_rank() == 0 else None
    with autocast(precision, torch.device("cpu")):
        embedded = model.transformer.wte(torch.zeros(1, 4, dtype=torch.long))
    return {"sharded": False, "residual_dtype": embedded.dtype, "linears": linears}


@pytest.mark.parametrize(
    ("mixed_precision", "precision", "residual_dtype"),
    [("PURE", "amp_bf16", torch.bfloat16), ("DEFAULT", "amp_bf16", torch.bfloat16), ("FULL", "amp_bf16", None),
     ("PURE", "fp32", torch.float32)],
)  # fmt: skip
def test_one_rank_skips_fsdp_but_keeps_its_activation_precision(
    ranks, mixed_precision, precision, residual_dtype, tmp_path
):
    fsdp = {"mixed_precision": mixed_precision, "cpu_offload": True}  # offload needs a GPU: ignored on a CPU
    result = ranks.run(1, placement, fsdp, precision, str(tmp_path))[0]
    assert not result["sharded"] and result["linears"] == ["AccumulatingLinear"]
    # FULL keeps fp32 parameters: the embedding's output stays fp32 under autocast, as it does under FSDP
    assert result["residual_dtype"] == (residual_dtype or torch.float32)


def test_two_ranks_are_sharded(ranks, tmp_path):
    result = ranks.run(2, placement, {}, "amp_bf16", str(tmp_path))[0]
    assert result["sharded"] and result["linears"] == ["Linear"]
