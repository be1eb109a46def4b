"""``mpt_causal_lm`` with LLM Foundry's MoE keys: the loss terms, their logging, the expert load and active FLOPs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import token_batches

from foundry.callbacks import MoEMonitor
from foundry.errors import ConfigError
from foundry.loggers.jsonl import JSONLLogger
from foundry.models import MPTCausalLM
from foundry.models.moe import MoE
from foundry.trainer import Trainer

MOE_FFN = {"ffn_type": "mb_dmoe", "moe_num_experts": 4, "moe_top_k": 2, "moe_loss_weight": 0.01}


def tiny_moe_mpt(**ffn_overrides: object) -> MPTCausalLM:
    torch.manual_seed(0)
    return MPTCausalLM(
        d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=16, expansion_ratio=1,
        attn_config={"attn_impl": "torch"}, loss_fn="torch_crossentropy", ffn_config={**MOE_FFN, **ffn_overrides},
    )  # fmt: skip


def test_mb_dmoe_builds_moe_blocks_with_megablocks_defaults() -> None:
    model = tiny_moe_mpt()
    ffn = model.transformer.blocks[0].ffn
    assert isinstance(ffn, MoE)
    assert ffn.experts.up_proj.shape == (4, 32, 32)  # experts, d_model * expansion_ratio, d_model
    assert ffn.bias is not None and ffn.experts.gate_proj is None  # mlp_type: mlp, and no_bias false
    assert ffn.config.act.approximate == "tanh"  # MegaBlocks' default activation


def test_training_loss_adds_the_weighted_load_balancing_loss() -> None:
    model = tiny_moe_mpt(moe_zloss_weight=0.001)
    batch = token_batches(1, 2, 16, 64)[0]
    loss = model.loss(model(batch), batch)
    terms = model.loss_terms()
    assert set(terms) == {"cross_entropy", "load_balancing", "router_z"}
    torch.testing.assert_close(loss.detach(), sum(terms.values()))
    assert terms["load_balancing"].item() == pytest.approx(0.01, rel=0.5)  # about the weight for a fresh router
    model.eval()
    assert model.loss(model(batch), batch).item() == pytest.approx(terms["cross_entropy"].item(), rel=1e-5)


def test_active_params_count_top_k_of_the_experts() -> None:
    model = tiny_moe_mpt()
    expert_params = sum(p.numel() for block in model.transformer.blocks for p in block.ffn.experts.parameters())
    assert model.num_params - model.n_active_params == expert_params // 2  # top-2 of 4 experts


def test_moe_world_size_points_to_the_distributed_section() -> None:
    with pytest.raises(ConfigError, match="moe_world_size.*distributed section"):
        tiny_moe_mpt(moe_world_size=2)


def test_loss_terms_and_expert_load_reach_the_logger(tmp_path: Path) -> None:
    model = tiny_moe_mpt()
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(
        model=model,
        train_dataloader=token_batches(2, 4, 16, 64),
        max_duration="2ba",
        device_train_microbatch_size=2,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[MoEMonitor()],
        loggers=[JSONLLogger(str(path))],
        log_to_console=False,
        device="cpu",
    )
    trainer.fit()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    logged = {key: row[key] for row in rows for key in row}
    assert {"loss/train/cross_entropy", "loss/train/load_balancing", "moe/layer_1/max_load"} <= set(logged)
    assert logged["loss/train/total"] == pytest.approx(
        logged["loss/train/cross_entropy"] + logged["loss/train/load_balancing"], rel=1e-5
    )
    assert 1.0 <= logged["moe/max_load"] <= 4.0
    assert model.transformer.blocks[0].ffn.assignments_since_read is None  # read and reset


def test_activation_checkpointing_keeps_loss_terms_and_gradients() -> None:
    from foundry.distributed.activation_checkpoint import apply_activation_checkpointing

    batch = token_batches(1, 2, 16, 64)[0]
    grads = []
    for checkpointed in (False, True):
        model = tiny_moe_mpt(moe_zloss_weight=0.001)
        if checkpointed:
            apply_activation_checkpointing(model, list(model.transformer.blocks), None, reentrant=False)
        model.loss(model(batch), batch).backward()
        unwrapped = {name.replace("._checkpoint_wrapped_module", ""): p for name, p in model.named_parameters()}
        grads.append({name: p.grad.clone() for name, p in unwrapped.items()})
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_reentrant_checkpointing_warns_that_the_router_loses_its_loss_terms() -> None:
    from foundry.distributed.activation_checkpoint import apply_activation_checkpointing

    model = tiny_moe_mpt()
    apply_activation_checkpointing(model, list(model.transformer.blocks), None, reentrant=True)
    batch = token_batches(1, 2, 16, 64)[0]
    with pytest.warns(UserWarning, match="reentrant activation checkpointing"):
        model(batch)
