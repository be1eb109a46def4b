"""LoRA layers on the native families: parameter counts, frozen base, config errors, merging, adapter switching."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import token_batches

from foundry.core.precision import cast_embeddings_to_autocast_dtype
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.lora import LoRALinear, adapter_state_dict, merged_state_dict
from foundry.optim import DecoupledAdamW
from foundry.peft.adapters import AdapterSet
from foundry.trainer import Trainer

TARGETS = ["Wqkv", "out_proj", "up_proj", "down_proj"]
LORA: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}


def lora_mpt(make_mpt, seed: int = 0, **peft: Any) -> MPTCausalLM:
    return make_mpt(seed, no_bias=True, peft_config={**LORA, **peft})


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Non-zero B (as after training), so the adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in adapter_state_dict(model).values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)


def test_trainable_parameter_count_is_r_times_in_plus_out_per_target(make_mpt, mpt_keys):
    model = lora_mpt(make_mpt)
    d_model, hidden, n_layers, r = 32, 4 * 32, 2, LORA["r"]
    shapes = [(d_model, 3 * d_model), (d_model, d_model), (d_model, hidden), (hidden, d_model)]  # (in, out)
    expected = n_layers * sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


def test_lora_model_starts_as_the_base_model(make_mpt, input_ids):
    base = make_mpt(0, no_bias=True).eval()
    lora = lora_mpt(make_mpt).eval()
    lora.load_state_dict(base.state_dict(), strict=False)
    torch.testing.assert_close(lora({"input_ids": input_ids}), base({"input_ids": input_ids}), atol=0, rtol=0)


def test_optimizer_holds_state_for_adapters_only(make_mpt, tmp_path):
    model = lora_mpt(make_mpt)
    trainer = Trainer(
        model, token_batches(1, 2, seq_len=16, vocab_size=64), max_duration="1ba", device="cpu",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-2), run_folder=str(tmp_path), log_to_console=False,
    )  # fmt: skip
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    trainer.fit()
    (optimizer,) = trainer.state.optimizers
    assert len(optimizer.state) == len(adapter_state_dict(model))
    assert not any(id(p) in frozen for p in optimizer.state)


def test_training_changes_only_the_adapters(make_mpt, tmp_path):
    model = lora_mpt(make_mpt)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    Trainer(
        model, token_batches(2, 2, seq_len=16, vocab_size=64), max_duration="2ba", device="cpu",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-2), run_folder=str(tmp_path), log_to_console=False,
    ).fit()  # fmt: skip
    changed = {name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])}
    assert changed and all(".lora_" in name for name in changed)
    assert any(".lora_B." in name for name in changed)


def test_target_that_matches_nothing_lists_the_linear_layers(make_mpt):
    with pytest.raises(ConfigError, match=r"'q_proj' matches no linear layer.*Wqkv, down_proj, out_proj, up_proj"):
        lora_mpt(make_mpt, target_modules=["Wqkv", "q_proj"])


def test_unknown_peft_key_suggests_the_right_one(make_mpt):
    with pytest.raises(ConfigError, match=r"model.peft_config.lora_alhpa'. Did you mean 'lora_alpha'"):
        make_mpt(0, peft_config={"lora_alhpa": 16, "target_modules": TARGETS})


def test_all_linear_targets_every_block_linear_but_not_the_output_head():
    model = LlamaCausalLM(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=64, max_seq_len=16, ffn_hidden_size=48,
        peft_config={"target_modules": "all-linear"},
    )  # fmt: skip
    adapted = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    assert adapted == {"Wqkv", "out_proj", "gate_proj", "up_proj", "down_proj"}
    assert not isinstance(model.lm_head, LoRALinear)


def test_merged_weights_compute_the_lora_model(make_mpt, input_ids):
    lora = lora_mpt(make_mpt, lora_dropout=0.1).eval()
    randomize_adapters(lora, seed=1)
    plain = make_mpt(5, no_bias=True).eval()
    plain.load_state_dict(merged_state_dict(lora))
    torch.testing.assert_close(plain({"input_ids": input_ids}), lora({"input_ids": input_ids}), atol=1e-5, rtol=0)


def test_adapter_set_switches_adapters_without_touching_the_base(make_mpt, input_ids):
    model = lora_mpt(make_mpt).eval()
    outputs, states = {}, {}
    for name, seed in (("a", 1), ("b", 2)):
        randomize_adapters(model, seed)
        states[name] = {key: tensor.clone() for key, tensor in adapter_state_dict(model).items()}
        outputs[name] = model({"input_ids": input_ids})
    base = {name: tensor.clone() for name, tensor in model.state_dict().items() if ".lora_" not in name}
    adapters = AdapterSet(model)
    for name, state in states.items():
        adapters.add(name, state)
    for name in ("a", "b", "a"):
        assert adapters.activate(name) >= 0
        torch.testing.assert_close(model({"input_ids": input_ids}), outputs[name], atol=0, rtol=0)
    for name, tensor in base.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_adapter_of_another_rank_is_refused(make_mpt):
    adapters = AdapterSet(lora_mpt(make_mpt))
    other = adapter_state_dict(lora_mpt(make_mpt, r=2))
    with pytest.raises(ConfigError, match="another rank r"):
        adapters.add("r2", other)


def test_adapters_only_checkpoints_need_a_base_load_path():
    from pathlib import Path

    from foundry.config import load_train_config
    from foundry.config.build import build_trainer

    yaml_path = Path(__file__).resolve().parents[2] / "yamls" / "finetune" / "quickstart-lora.yaml"
    cfg, _ = load_train_config(yaml_path, ["load_path=null"])
    with pytest.raises(ConfigError, match="save_adapters_only: true .* set load_path"):
        build_trainer(cfg)


def test_bf16_base_stores_frozen_weights_in_bf16_and_computes_as_bf16_autocast_does(make_mpt, input_ids):
    fp32_base = lora_mpt(make_mpt).eval()
    randomize_adapters(fp32_base, seed=2)
    bf16_base = lora_mpt(make_mpt, base_dtype="bfloat16").eval()
    bf16_base.load_state_dict(fp32_base.state_dict())
    frozen = [p for p in bf16_base.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in bf16_base.parameters() if p.requires_grad)  # the master weights
    cast_embeddings_to_autocast_dtype(fp32_base)  # a bf16 residual stream, as a bf16 embedding table gives
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, reference = (model({"input_ids": input_ids}) for model in (bf16_base, fp32_base))
    # autocast reads the fp32 weights in bf16 for each GEMM: storing them so changes nothing computed
    torch.testing.assert_close(ours, reference, atol=0, rtol=0)


def test_bf16_base_with_fp32_precision_is_refused_naming_both_keys():
    from pathlib import Path

    from foundry.config import load_train_config
    from foundry.config.build import check_settings

    yaml_path = Path(__file__).resolve().parents[2] / "yamls" / "finetune" / "quickstart-lora.yaml"
    cfg, _ = load_train_config(yaml_path, ["model.peft_config.base_dtype=bfloat16", "precision=fp32"])
    with pytest.raises(ConfigError, match=r"'model\.peft_config\.base_dtype' is 'bfloat16' but precision is fp32"):
        check_settings(cfg)


def test_the_70b_lora_yaml_stores_its_base_in_bf16_and_trains_fp32_adapters():
    from pathlib import Path

    from foundry.config import load_train_config
    from foundry.models.build import build_model

    yaml_path = Path(__file__).resolve().parents[2] / "yamls" / "finetune" / "llama-70b-lora.yaml"
    model = build_model(load_train_config(yaml_path, ["model.init_device=meta"])[0].model)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16} and {p.dtype for p in adapters} == {torch.float32}
    # the YAML's arithmetic: 70.55B base weights (141 GB in bf16), 0.19B adapter parameters
    assert sum(p.numel() for p in frozen) == 70_553_706_496
    assert sum(p.numel() for p in adapters) == 186_122_240


def test_checkpoint_with_only_some_of_the_models_adapters_is_refused(make_mpt):
    from foundry.models.lora_checkpoint import lora_checkpoint_hooks

    hooks = lora_checkpoint_hooks(lora_mpt(make_mpt))
    adapters = set(adapter_state_dict(lora_mpt(make_mpt)))
    wqkv_only = {key for key in adapters if ".Wqkv." in key}  # a run with target_modules [Wqkv]
    base = {"transformer.wte.weight", "transformer.blocks.0.attn.Wqkv.weight"}
    assert hooks.loadable_without(adapters, base)  # a base checkpoint: the adapters keep their init
    assert hooks.loadable_without(base, adapters)  # adapters only: the base was loaded before
    assert not hooks.loadable_without(adapters - wqkv_only, wqkv_only)
    assert not hooks.loadable_without(adapters - wqkv_only, base | wqkv_only)
