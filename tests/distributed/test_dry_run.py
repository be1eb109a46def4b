"""``foundry train --dry-run``: the layout planned on torch's fake process group matches what real ranks hold."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from foundry import cli
from foundry.config import load_train_config
from foundry.config.dry_run import dry_run
from foundry.distributed.config import FSDPConfig
from foundry.distributed.placement import place_model
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.optim.optimizers import DecoupledAdamW

YAMLS = Path(__file__).resolve().parents[2] / "yamls"
TINY = [
    "model.d_model=64",
    "model.n_layers=3",
    "model.n_heads=4",
    "model.kv_n_heads=2",
    "model.vocab_size=250",  # odd rows per rank at 8 ranks: FSDP2 rounds rank 0's shard up
    "model.ffn_hidden_size=100",
    "precision=fp32",
    "fsdp_config={sharding_strategy: FULL_SHARD}",
    "fsdp_config.reshard_between_microbatches=true",  # the large-model schedule: gradients live as shards
    "global_train_batch_size=8",
    "variables.max_seq_len=16",
]
MOMENTS = ("exp_avg", "exp_avg_sq")
LLAMA_405B_SHAPE = [
    "model.n_layers=126",
    "model.d_model=16384",
    "model.n_heads=128",
    "model.kv_n_heads=8",
    "model.ffn_hidden_size=53248",
    "model.vocab_size=128256",
]


def tiny_config(*overrides: str):
    return load_train_config(YAMLS / "quickstart-llama.yaml", [*TINY, *overrides])[0]


def held_by_rank(model_section: dict, moments_dtype: str) -> dict[str, int]:
    """Bytes this rank's FSDP2 shards hold after one real step: parameters, gradients, Adam's moments."""
    torch.manual_seed(0)
    model = build_model(model_section)
    place_model(model, torch.device("cpu"), FSDPConfig(), "fp32")
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = DecoupledAdamW(trainable, lr=1e-3, moments_dtype=moments_dtype)
    batch = {"input_ids": torch.randint(0, model.config.vocab_size, (2, 16))}
    model.loss(model(batch), batch).backward()
    optimizer.step()

    def local_bytes(tensors):
        return sum(t.to_local().numel() * t.element_size() for t in tensors)

    states = [state[name] for state in optimizer.state.values() for name in MOMENTS]
    return {
        "parameters": local_bytes(model.parameters()),
        "gradients": local_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": local_bytes(states),
    }


def planned(plan) -> dict[str, int]:
    memory = plan.memory_bytes
    return {
        "parameters": memory["parameters (shards)"],
        "gradients": memory["gradients"],
        "optimizer": memory["optimizer (2 states)"],
    }


@pytest.mark.parametrize("moments_dtype", ["float32", "bfloat16"])
def test_two_rank_plan_holds_what_real_ranks_hold(ranks, moments_dtype):
    cfg = tiny_config(f"optimizer.moments_dtype={moments_dtype}", "model.init_device=cpu")
    plan = dry_run(cfg, world_size=2)
    held = ranks.run(2, held_by_rank, cfg.model, moments_dtype)
    assert planned(plan) == held[0]  # rank 0 holds the rounded-up share: the per-GPU peak
    assert held[0]["parameters"] >= held[1]["parameters"]


def test_two_rank_lora_plan_holds_what_real_ranks_hold(ranks):
    lora = "model.peft_config={r: 4, lora_alpha: 8, target_modules: all-linear}"
    cfg = tiny_config(lora, "model.init_device=cpu")
    plan = dry_run(cfg, world_size=2)
    held = ranks.run(2, held_by_rank, cfg.model, "float32")
    assert planned(plan) == held[0]
    assert planned(plan)["optimizer"] < planned(plan)["parameters"] / 4  # the adapters' moments alone


def test_lora_base_stored_in_bf16_halves_the_planned_base_and_nothing_else():
    lora = "model.peft_config={r: 4, lora_alpha: 8, target_modules: all-linear}"
    fp32, bf16 = (
        planned(dry_run(tiny_config(lora, f"model.peft_config.base_dtype={dtype}", "precision=amp_bf16"), 2))
        for dtype in ("float32", "bfloat16")
    )
    adapters = 4 * sum(
        math.ceil(p.shape[0] / 2) * p[0].numel()
        for p in build_model({**tiny_config(lora).model, "init_device": "meta"}).parameters()
        if p.requires_grad
    )
    assert bf16["parameters"] - adapters == (fp32["parameters"] - adapters) // 2
    assert (bf16["gradients"], bf16["optimizer"]) == (fp32["gradients"], fp32["optimizer"]) == (adapters, 2 * adapters)


@pytest.mark.parametrize(
    ("yaml", "world_size", "limit_gib"),
    [("llama-70b-qlora.yaml", 2, 72), ("llama-70b-lora.yaml", 4, 72), ("llama-405b-qlora.yaml", 4, 120)],
)
def test_largest_finetune_yamls_plan_within_their_cards(yaml, world_size, limit_gib):
    pytest.importorskip("torchao")
    cfg = load_train_config(YAMLS / "finetune" / yaml, [])[0]
    plan = dry_run(cfg, world_size=world_size, ranks_per_node=world_size)
    assert plan.total_bytes / 2**30 <= limit_gib
    assert plan.memory_bytes["optimizer (2 states)"] < 2 * 2**30  # Adam's moments of the adapters alone


def test_tensor_parallelism_is_refused_naming_the_key():
    cfg = tiny_config("parallelism.tensor_parallel_degree=2")
    with pytest.raises(ConfigError, match=r"'parallelism\.tensor_parallel_degree' is 2; the dry run does not plan"):
        dry_run(cfg, world_size=4)


def test_eight_rank_plan_holds_fsdp2s_rounded_up_shards():
    cfg = tiny_config()
    plan = dry_run(cfg, world_size=8)
    model = build_model({**cfg.model, "init_device": "meta"})
    # FSDP2 splits each parameter along its first dimension; rank 0 gets ceil(rows / ranks) of them
    elements = sum(math.ceil(p.shape[0] / 8) * p[0].numel() for p in model.parameters())
    assert planned(plan) == {"parameters": 4 * elements, "gradients": 4 * elements, "optimizer": 8 * elements}
    assert plan.mesh == {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "ep": 1}


def test_one_gpu_plan_holds_the_whole_model_and_sends_nothing():
    plan = dry_run(tiny_config(), world_size=1)
    assert plan.collectives == [] and plan.fsdp_units == 0
    assert plan.memory_bytes["parameters (shards)"] == 4 * plan.parameters


def test_expert_parallel_plan_splits_the_experts_and_sends_routed_rows():
    overrides = ["fsdp_config={}", "parallelism.expert_parallel_degree=2", "precision=fp32"]
    cfg = load_train_config(YAMLS / "quickstart-moe.yaml", overrides)[0]
    plan = dry_run(cfg, world_size=2)
    model = build_model({**cfg.model, "init_device": "meta"})
    # each rank holds half of every layer's experts (EP) and half the rows of every other parameter (FSDP2)
    elements = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in model.parameters())
    assert plan.memory_bytes["parameters (shards)"] == 4 * elements
    assert (plan.collectives[-1].op, plan.collectives[-1].what) == ("all-to-all", "routed rows (dispatch, combine)")


def test_collectives_follow_the_fsdp_units():
    cfg = tiny_config("device_train_microbatch_size=1", "fsdp_config.reshard_between_microbatches=true")
    plan = dry_run(cfg, world_size=2)  # 4 samples a GPU: 4 microbatches, resharded and reduced every one
    gathers, reductions = plan.collectives
    units = 3 + 1  # blocks, then the root
    assert (gathers.op, reductions.op) == ("all-gather", "reduce-scatter")
    assert reductions.calls_per_step == 4 * units
    assert gathers.calls_per_step == 4 * (units + 2)  # backward gathers the blocks again, but the last
    assert reductions.bytes_per_step == 4 * 4 * plan.parameters  # fp32 (precision fp32) every microbatch


def test_context_parallel_plan_gathers_keys_and_values():
    plan = dry_run(tiny_config("parallelism.context_parallel_degree=2"), world_size=4)
    assert plan.mesh == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "ep": 1}
    assert plan.tokens_per_microbatch == 2 * 16 // 2  # each rank holds half of every sequence
    assert [c.what for c in plan.collectives][2:] == ["k and v", "k and v gradients"]


def test_hybrid_shard_plan_replicates_across_nodes():
    plan = dry_run(tiny_config("fsdp_config.sharding_strategy=HYBRID_SHARD"), world_size=8, ranks_per_node=4)
    assert plan.mesh == {"dp_replicate": 2, "dp_shard": 4, "cp": 1, "ep": 1}
    assert plan.collectives[-1].op == "all-reduce"


@pytest.mark.parametrize(
    ("overrides", "world_size", "key"),
    [
        (["parallelism.context_parallel_degree=2"], 3, "'parallelism.context_parallel_degree' is 2"),
        ([], 3, "global_train_batch_size (8) is not divisible"),
        ([], 12, "--world-size 12 is not a whole number of nodes of --nproc 8"),
        (["model={name: hf_causal_lm, pretrained_model_name_or_path: gpt2}"], 2, "'model.name' is 'hf_causal_lm'"),
    ],
)
def test_a_world_size_the_mesh_cannot_divide_is_refused(overrides, world_size, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        dry_run(tiny_config(*overrides), world_size=world_size)


def test_kept_gathered_schedule_holds_unsharded_gradient_sums():
    plan = dry_run(tiny_config("fsdp_config.reshard_between_microbatches=null"), world_size=2)
    assert plan.kept_gathered  # two copies of a tiny model fit a quarter of any GPU
    assert plan.memory_bytes["gradients"] == 4 * plan.parameters  # precision fp32: fp32 sums of the whole model


def test_llama_405b_shape_on_1024_ranks_plans_on_a_cpu():
    started = time.perf_counter()
    every_block = "fsdp_config.activation_checkpointing=true"  # the YAML's auto plans through choose_checkpointing
    cfg = load_train_config(YAMLS / "pretrain" / "llama-8b.yaml", [*LLAMA_405B_SHAPE, every_block])[0]
    plan = dry_run(cfg, world_size=1024)
    assert time.perf_counter() - started < 60
    assert plan.parameters == pytest.approx(405.9e9, rel=1e-3)
    assert plan.mesh["dp_shard"] == 1024
    # 405.9B fp32 parameters over 1,024 ranks: 1.5 GiB of shards a GPU
    assert plan.memory_bytes["parameters (shards)"] / 2**30 == pytest.approx(1.48, abs=0.01)


def test_cli_prints_the_plan_and_exits_0(capsys):
    argv = ["train", str(YAMLS / "quickstart-llama.yaml"), *TINY, "--dry-run", "--world-size", "16"]
    assert cli.main(argv) == 2  # 8 samples cannot split over 16 GPUs
    assert "global_train_batch_size" in capsys.readouterr().err
    assert cli.main([*argv, "global_train_batch_size=32"]) == 0
    out = capsys.readouterr().out
    assert "dry run: 16 ranks (2 nodes of 8)" in out
    assert "all-gather parameters" in out and "total" in out
    assert cli.main([*argv, "global_train_batch_size=32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 16
