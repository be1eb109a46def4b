"""QLoRA under FSDP2: NF4 base weights sharded and gathered in 4 bits, fp32 adapters, train as one process does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distributed.jobs import build_trainer, full_weights, train
from foundry.checkpoint.load import load_checkpoint
from foundry.checkpoint.save import save_checkpoint
from foundry.convert.checkpoint_io import save_weights_checkpoint
from foundry.distributed import get_rank
from foundry.models.build import build_model
from foundry.models.lora import is_adapter_key
from foundry.models.nf4 import torchao_nf4

pytest.importorskip("torchao")

NUM_BATCHES = 4
# 256 wide: each rank's half of every adapted weight is whole NF4 scale blocks (64 × 256 weights).
QLORA_LLAMA = {
    "name": "llama_causal_lm", "d_model": 256, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": 64,
    "max_seq_len": 16, "multiple_of": 256, "ffn_dim_multiplier": None, "rope_theta": 10000.0,
    "peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "quantize_base": True},
}  # fmt: skip


def two_ranks_and_one(ranks, tmp_path, init_device: str) -> tuple[dict, dict]:
    model_keys = {**QLORA_LLAMA, "init_device": init_device}
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=model_keys)[0]
    fsdp_config = {"sharding_strategy": "FULL_SHARD"}
    two = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "two"), fsdp_config, model_keys=model_keys)[0]
    assert sorted(two["losses"]) == list(range(1, NUM_BATCHES + 1))
    assert two["weights"].keys() == one["weights"].keys()
    assert any(not torch.equal(w, 0 * w) for n, w in two["weights"].items() if ".lora_B." in n)  # adapters trained
    return one, two


def test_qlora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    one, two = two_ranks_and_one(ranks, tmp_path, "cpu")
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-5), step
    for name, weight in one["weights"].items():
        if is_adapter_key(name):  # Adam divides by sqrt(v): round-off in tiny gradients grows to ~1e-5
            torch.testing.assert_close(two["weights"][name], weight, atol=5e-5, rtol=0, msg=name)
        else:  # the NF4 codes went through FSDP2's shards and all-gathers unchanged
            assert torch.equal(two["weights"][name], weight), name


def test_qlora_built_on_meta_trains_on_two_ranks_from_rank_0s_weights(ranks, tmp_path):
    # Each rank quantizes its shard of rank 0's bf16 values: NF4's second-level scales are centred on the mean of
    # the shard's scales, not the whole weight's, so a base weight may differ from one rank's in its last bit.
    # Adam's first steps follow the sign of near-zero gradients, so the adapters are compared through the loss.
    one, two = two_ranks_and_one(ranks, tmp_path, "meta")
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-3), step
    for name, weight in one["weights"].items():
        if not is_adapter_key(name):
            bf16_step = 2.0 ** (torch.frexp(weight.abs().max().float()).exponent.item() - 8)
            torch.testing.assert_close(two["weights"][name], weight, atol=bf16_step, rtol=0, msg=name)


@contextlib.contextmanager
def counted_dequantizations() -> Iterator[list[torch.Size]]:
    """The shapes of the NF4 weights (or shards) dequantized within: torchao's ``get_original_weight`` counted."""
    nf4_tensor = torchao_nf4().NF4Tensor
    original, shapes = nf4_tensor.get_original_weight, []

    def counted(self: Any) -> torch.Tensor:
        shapes.append(self.shape)
        return original(self)

    nf4_tensor.get_original_weight = counted
    try:
        yield shapes
    finally:
        nf4_tensor.get_original_weight = original


def save_and_load_adapters_only(folder: str, fsdp_config: dict | None) -> dict | None:
    """After one batch, an adapters-only checkpoint saved as it is now and as the whole state dict filtered (what
    it was), their contents on rank 0, and the NF4 dequantizations of each save and of loading the first back."""
    section = {**QLORA_LLAMA, "peft_config": {**QLORA_LLAMA["peft_config"], "save_adapters_only": True}}
    trainer = build_trainer(1, folder, fsdp_config, model_keys=section)
    trainer.fit()
    state, hooks = trainer.state, trainer.state.model.checkpoint_hooks
    with counted_dequantizations() as save_calls:
        now = save_checkpoint(f"{folder}/now", state)
    with (
        counted_dequantizations() as whole_state_calls,
        mock.patch.object(type(hooks), "saves_frozen_weights", lambda _: True),
    ):
        whole = save_checkpoint(f"{folder}/whole", state)  # the whole state dict built, the base then dropped
    with counted_dequantizations() as load_calls:
        load_checkpoint(now, state)
    if get_rank() != 0:
        return None
    contents = {}
    for name, path in (("now", now), ("whole", whole)):
        dcp_to_torch_save(path, f"{folder}/{name}.pt")
        contents[name] = torch.load(f"{folder}/{name}.pt", weights_only=True)
    return {"save": save_calls, "whole_state": whole_state_calls, "load": load_calls, **contents}


@pytest.mark.parametrize("world_size", [1, 2])
def test_adapters_only_checkpoints_save_and_load_without_dequantizing_the_nf4_base(ranks, tmp_path, world_size):
    fsdp_config = {"sharding_strategy": "FULL_SHARD"} if world_size > 1 else None
    result = ranks.run(world_size, save_and_load_adapters_only, str(tmp_path), fsdp_config)[0]
    assert result["whole_state"]  # the counter sees the dequantizations a whole state dict does
    assert result["save"] == [] and result["load"] == []
    assert result["now"].keys() == result["whole"].keys()
    assert all(is_adapter_key(key) for key in result["now"]["model"])
    torch.testing.assert_close(result["now"]["model"], result["whole"]["model"], atol=0, rtol=0)
    torch.testing.assert_close(result["now"]["optim"]["state"], result["whole"]["optim"]["state"], atol=0, rtol=0)
    assert result["now"]["optim"]["param_groups"] == result["whole"]["optim"]["param_groups"]


def load_base_into_qlora(folder: str, fsdp_config: dict | None, base: str, whole_at_once: bool) -> dict | None:
    """A QLoRA model's weights after its base checkpoint loads (as a run's ``load_path`` does), and the parts the
    load went in; ``whole_at_once``: every key in one part (the whole share dequantized, as loads were before)."""
    from foundry.models import lora_checkpoint

    trainer = build_trainer(1, folder, fsdp_config, model_keys=QLORA_LLAMA)
    by_block, parts = lora_checkpoint.keys_by_block, []

    def grouped(model_state: dict) -> list[list[str]]:
        parts[:] = [list(model_state)] if whole_at_once else by_block(model_state)
        return parts

    with mock.patch.object(lora_checkpoint, "keys_by_block", grouped):
        load_checkpoint(base, trainer.state, weights_only=True)
    weights = full_weights(trainer.state.model)
    return {"weights": weights, "parts": len(parts)} if get_rank() == 0 else None


@pytest.mark.parametrize("world_size", [1, 2])
def test_nf4_model_loads_its_base_a_block_at_a_time_as_it_did_whole(ranks, tmp_path, world_size):
    plain = {key: value for key, value in QLORA_LLAMA.items() if key != "peft_config"}
    torch.manual_seed(0)
    base_model = build_model(plain)
    base = save_weights_checkpoint(base_model, tmp_path / "base", {"model": plain}, overwrite=False)
    fsdp_config = {"sharding_strategy": "FULL_SHARD"} if world_size > 1 else None
    by_block, whole = (
        ranks.run(world_size, load_base_into_qlora, str(tmp_path / name), fsdp_config, str(base), name == "whole")[0]
        for name in ("by_block", "whole")
    )
    assert (by_block["parts"], whole["parts"]) == (QLORA_LLAMA["n_layers"] + 1, 1)
    for name, weight in whole["weights"].items():
        assert torch.equal(by_block["weights"][name], weight), name
    for name, weight in base_model.state_dict().items():  # the base did load: NF4 weights within 4 bits' rounding
        error = (whole["weights"][name].float() - weight).norm()
        assert error == 0 if weight.dim() < 2 or "wte" in name else error < 0.2 * weight.norm(), name


def save_full_checkpoint_with_rank_1_short_of_memory(folder: str) -> str:
    """Each rank's error when rank 1's GPU lacks the room for the full checkpoint's bf16 base and rank 0's has it."""
    from foundry.errors import CheckpointError
    from foundry.models import lora_checkpoint

    trainer = build_trainer(1, folder, {"sharding_strategy": "FULL_SHARD"}, model_keys=QLORA_LLAMA)
    free_bytes = 2**40 if get_rank() == 0 else 2**20
    with mock.patch.object(lora_checkpoint, "device_free_bytes", lambda device: free_bytes):
        try:
            save_checkpoint(f"{folder}/ckpt", trainer.state)
        except CheckpointError as error:
            return str(error)
    return "saved"


def test_full_qlora_checkpoint_one_rank_cannot_build_is_refused_on_every_rank(ranks, tmp_path):
    errors = ranks.run(2, save_full_checkpoint_with_rank_1_short_of_memory, str(tmp_path))
    assert all("Set model.peft_config.save_adapters_only: true" in error for error in errors), errors
    assert not (tmp_path / "ckpt").exists()
