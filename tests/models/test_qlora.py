"""QLoRA: NF4 base weights (round trip, frozen, 4 bits), forward/backward against a dequantized reference, exports
that transformers loads alone, and the configs refused at start."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.models.lora import adapter_state_dict, is_adapter_key
from foundry.models.nf4 import BLOCK_SIZE, dequantize, is_nf4, torchao_nf4

pytest.importorskip("torchao")

YAMLS = Path(__file__).resolve().parents[2] / "yamls" / "finetune"

# 256 wide so every adapted weight (and each half of it, for 2 FSDP2 ranks) is whole NF4 scale blocks.
QLORA_LLAMA: dict[str, Any] = {
    "name": "llama_causal_lm", "d_model": 256, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": 96,
    "max_seq_len": 16, "multiple_of": 256, "ffn_dim_multiplier": None, "rope_theta": 10000.0,
    "peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "quantize_base": True},
}  # fmt: skip


def qlora_llama(seed: int = 0, section: dict[str, Any] = QLORA_LLAMA) -> torch.nn.Module:
    """A QLoRA Llama whose adapters are non-zero, as after training."""
    torch.manual_seed(seed)
    model = build_model(section)
    with torch.no_grad():
        for tensor in adapter_state_dict(model).values():
            tensor.normal_(std=0.05)
    return model


def dequantized_reference(qlora: torch.nn.Module) -> torch.nn.Module:
    """The same model as plain LoRA in fp32, its base weights the NF4 weights' values."""
    reference = build_model({**QLORA_LLAMA, "peft_config": {**QLORA_LLAMA["peft_config"], "quantize_base": False}})
    reference.load_state_dict(qlora.state_dict())
    return reference


def test_nf4_round_trip_is_within_half_a_code_step_of_each_block_absmax():
    weight = torch.randn(256, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    codes = torchao_nf4().to_nf4(weight)
    values = dequantize(codes)
    block_absmax = weight.float().reshape(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True)
    errors = (values.float() - weight.float()).reshape(-1, BLOCK_SIZE).abs()
    # NF4's widest gap between codes is 1 - 0.6962; block scales are 8-bit, so allow a little more.
    assert (errors <= 0.5 * (1 - 0.6962) * block_absmax * 1.05).all()
    assert codes.quantized_data.numel() == weight.numel() // 2  # two 4-bit codes a byte


def test_qlora_base_is_frozen_nf4_and_adapters_train_in_fp32():
    model = qlora_llama()
    base = [(name, p) for name, p in model.named_parameters() if is_nf4(p)]
    assert len(base) == 2 * 5  # Wqkv, out_proj, gate/up/down_proj per block
    assert not any(p.requires_grad for _, p in base)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(base) and all(p.dtype == torch.float32 for p in trainable)
    assert all(model.state_dict()[f"{name}"].dtype == torch.bfloat16 for name, _ in base)  # saved as bf16 values


def test_qlora_forward_and_backward_match_the_dequantized_reference():
    qlora = qlora_llama()
    reference = dequantized_reference(qlora)
    input_ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    outputs = [model({"input_ids": input_ids}) for model in (qlora, reference)]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    for output in outputs:
        output.square().mean().backward()
    for (name, ours), (_, theirs) in zip(qlora.named_parameters(), reference.named_parameters(), strict=True):
        if ours.requires_grad:
            torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_qlora_built_on_meta_holds_nf4_and_initialises_on_cpu():
    torch.manual_seed(0)
    model = build_model({**QLORA_LLAMA, "init_device": "meta"})
    weight = model.transformer.blocks[0].attn.Wqkv.weight
    assert is_nf4(weight) and weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    weight = model.transformer.blocks[0].attn.Wqkv.weight
    assert is_nf4(weight) and torch.isfinite(dequantize(weight)).all() and dequantize(weight).std() > 0


def test_peft_adapter_and_merged_export_load_in_transformers_alone(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from foundry.convert.hf_export import to_hf_model
    from foundry.peft.export import merged_model, write_peft_adapter

    qlora = qlora_llama().eval()
    input_ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = qlora({"input_ids": input_ids})
    plain_section = {key: value for key, value in QLORA_LLAMA.items() if key != "peft_config"}
    base = build_model(plain_section)
    base.load_state_dict({name: t for name, t in qlora.state_dict().items() if not is_adapter_key(name)})
    to_hf_model(base, "llama_causal_lm").save_pretrained(tmp_path / "base")
    write_peft_adapter(qlora, "llama_causal_lm", tmp_path / "adapter", str(tmp_path / "base"))
    merged, _ = merged_model(qlora, QLORA_LLAMA)
    to_hf_model(merged, "llama_causal_lm").save_pretrained(tmp_path / "merged")

    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    for hf_model in (adapted.eval(), AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()):
        with torch.no_grad():
            torch.testing.assert_close(hf_model(input_ids=input_ids).logits, ours, atol=1e-5, rtol=1e-5)


def test_merge_to_hf_writes_bf16_that_transformers_loads_alone_with_the_fp32_merge_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from foundry.convert.checkpoint_io import save_weights_checkpoint
    from foundry.data import builtin_corpus_documents, train_bpe_tokenizer
    from foundry.peft.export import add_merge_arguments, merged_model, run_merge

    section = {**QLORA_LLAMA, "vocab_size": 320}  # covers the 300-token tokenizer
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=tmp_path / "tokenizer")
    qlora = qlora_llama(section=section)
    config = {"model": section, "tokenizer": {"name": str(tmp_path / "tokenizer")}}
    save_weights_checkpoint(qlora, tmp_path / "run", config, overwrite=False)
    parser = argparse.ArgumentParser()
    add_merge_arguments(parser)
    assert run_merge(parser.parse_args([str(tmp_path / "run"), str(tmp_path / "merged"), "--hf"])) == 0

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto").eval()
    assert hf_model.config.dtype == torch.bfloat16
    assert all(parameter.dtype == torch.bfloat16 for parameter in hf_model.parameters())
    reference, _ = merged_model(qlora, section)  # the fp32 merge
    input_ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf_model.float()(input_ids=input_ids).logits  # the bf16 weights, computed in fp32
        ours = reference({"input_ids": input_ids})
    assert reference.transformer.blocks[0].attn.Wqkv.weight.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: each weight is within 2^-9 of its fp32 sum, relatively
    torch.testing.assert_close(theirs, ours, atol=2e-2, rtol=2e-2)
    assert not torch.equal(theirs, ours)  # the weights really were rounded


def test_qlora_without_torchao_is_refused_naming_the_key_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails as on an image without torchao
    with pytest.raises(ConfigError, match=r"model\.peft_config\.quantize_base.*pip install torchao"):
        build_model(QLORA_LLAMA)


def test_weight_that_is_not_whole_nf4_blocks_is_refused_naming_the_layer():
    section = {**QLORA_LLAMA, "d_model": 64, "multiple_of": 32}
    with pytest.raises(ConfigError, match=r"quantize_base.*Wqkv\.weight is \(128, 64\)"):
        build_model(section)


def qlora_70b_config(*overrides: str) -> Any:
    from foundry.config import load_train_config

    return load_train_config(YAMLS / "llama-70b-qlora.yaml", ["model.init_device=meta", *overrides])[0]


def test_the_70b_yaml_stores_its_adapted_weights_in_4_bits():
    model = build_model(qlora_70b_config().model)
    nf4_weights = [p for p in model.parameters() if is_nf4(p)]
    assert len(nf4_weights) == 80 * 5
    numel = sum(p.numel() for p in nf4_weights)
    assert numel == 68_451_041_280  # docs/LORA.md's arithmetic: 68.5B weights, 4.13 bits each
    stored_bytes = sum(p.quantized_data.numel() + p.quantized_scalers.numel() + 4 * p.quantization_factor.numel()
                       for p in nf4_weights)  # fmt: skip
    assert stored_bytes == pytest.approx(numel * 4.127 / 8, rel=1e-3)


def test_qlora_with_float8_is_refused_at_start_naming_both_keys():
    from foundry.config.build import check_settings

    cfg = qlora_70b_config()
    cfg = dataclasses.replace(cfg, algorithms={**cfg.algorithms, "float8": {}})
    with pytest.raises(ConfigError, match=r"quantize_base: true' \(QLoRA\) and algorithms\.float8"):
        check_settings(cfg)


def test_float8_algorithm_refuses_a_model_with_nf4_weights():
    from foundry.algorithms.float8 import Float8Training
    from foundry.core.event import Event

    state = SimpleNamespace(model=qlora_llama(), device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="algorithms.float8 cannot be combined"):
        Float8Training().apply(Event.INIT, state, logger=None)


def test_nf4_base_for_a_full_finetune_is_refused_at_start_naming_the_key():
    from foundry.config.build import check_settings

    cfg = qlora_70b_config()
    section = {key: value for key, value in cfg.model.items() if key != "peft_config"}
    with pytest.raises(ConfigError, match=r"'model\.quantize_base': 4-bit NF4 weights are frozen"):
        check_settings(dataclasses.replace(cfg, model={**section, "quantize_base": True}))


@pytest.mark.slow  # 11-23 s on the shared 2 cores: five 256-wide models quantized, two trained batches
def test_adapters_only_qlora_checkpoint_reloads_and_evaluates_on_its_base(tmp_path):
    from helpers import token_batches

    from foundry.checkpoint import resolve_checkpoint_path
    from foundry.convert.checkpoint_io import load_checkpoint_model, save_weights_checkpoint
    from foundry.eval.adapters import _base_model
    from foundry.optim import DecoupledAdamW
    from foundry.peft.adapters import AdapterSet
    from foundry.trainer import Trainer

    plain = {key: value for key, value in QLORA_LLAMA.items() if key != "peft_config"}
    torch.manual_seed(0)
    save_weights_checkpoint(build_model(plain), tmp_path / "base", {"model": plain}, overwrite=False)
    section = {**QLORA_LLAMA, "peft_config": {**QLORA_LLAMA["peft_config"], "save_adapters_only": True}}
    trainer = Trainer(
        build_model(section), token_batches(2, 2, seq_len=16, vocab_size=96), device="cpu", max_duration="2ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=3e-2), run_folder=str(tmp_path / "run"),
        save_folder=str(tmp_path / "ckpt"), load_path=str(tmp_path / "base"), load_weights_only=True,
        log_to_console=False, config={"model": section, "load_path": str(tmp_path / "base")},
    )  # fmt: skip
    trainer.fit()
    input_ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = trainer.state.model.eval()({"input_ids": input_ids})
        reloaded = load_checkpoint_model(resolve_checkpoint_path(tmp_path / "ckpt"), section).eval()
        torch.testing.assert_close(reloaded({"input_ids": input_ids}), trained, atol=0, rtol=0)
        on_base, _ = _base_model(tmp_path / "base", section)  # foundry eval --model base --adapters ckpt
        adapters = AdapterSet(on_base.eval())
        adapters.load("qlora", tmp_path / "ckpt")
        adapters.activate("qlora")
        torch.testing.assert_close(on_base({"input_ids": input_ids}), trained, atol=0, rtol=0)
    assert is_nf4(on_base.transformer.blocks[0].attn.Wqkv.weight)


def run_the_70b_yaml_on_this_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``foundry train yamls/finetune/llama-70b-qlora.yaml`` on random weights, with a local tokenizer and data."""
    import json

    from foundry import cli
    from foundry.data import builtin_corpus_documents, train_bpe_tokenizer

    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=tmp_path / "tokenizer")
    rows = [{"prompt": f"What is {i} + {i}?", "response": f"{2 * i}."} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = cli.main([
        "train", str(YAMLS / "llama-70b-qlora.yaml"), "load_path=", "model.peft_config.save_adapters_only=false",
        "save_folder=", f"variables.tokenizer_name={tmp_path / 'tokenizer'}", "train_loader.num_workers=0",
        f"variables.train_file={tmp_path / 'rows.jsonl'}", f"variables.eval_file={tmp_path / 'rows.jsonl'}",
    ])  # fmt: skip
    return code, capsys.readouterr().err


def test_the_70b_yaml_on_a_cpu_host_too_small_is_one_paragraph_naming_gpus(tmp_path, capsys, monkeypatch):
    from foundry.distributed import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 16 * 10**9)  # this shared CPU: 23 GB in all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host also where the suite has GPUs
    code, err = run_the_70b_yaml_on_this_cpu(tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    (message,) = [line for line in err.splitlines() if line.startswith("error: ")]
    # 68.45B weights in NF4 (35.3 GB) and as bf16 (136.9 GB), 2.1B fp32 embeddings and head, 0.19B fp32 adapters
    assert "The model (70.7B parameters) takes 181.4 GB" in message and "16.0 GB available" in message
    assert "trains on GPUs: run `foundry train CFG --nproc N`" in message


def test_the_70b_yaml_without_torchao_is_one_paragraph_naming_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails as on an image without torchao
    code, err = run_the_70b_yaml_on_this_cpu(tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    (message,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "model.peft_config.quantize_base" in message and "pip install torchao" in message


def test_full_qlora_checkpoint_that_would_not_fit_the_gpu_is_refused_naming_save_adapters_only(tmp_path, monkeypatch):
    from foundry.checkpoint.save import save_checkpoint
    from foundry.core import State, Time
    from foundry.errors import CheckpointError
    from foundry.models import lora_checkpoint

    monkeypatch.setattr(lora_checkpoint, "device_free_bytes", lambda device: 2**20)  # a GPU with 1 MiB free
    state = State(model=qlora_llama(), max_duration=Time.parse("1ba"))
    with pytest.raises(CheckpointError, match=r"GiB free\. Set model\.peft_config\.save_adapters_only: true"):
        save_checkpoint(tmp_path / "full", state)
    assert not (tmp_path / "full").exists()
    adapters_only = dataclasses.replace(state.model.config.peft_config, save_adapters_only=True)
    monkeypatch.setattr(state.model.config, "peft_config", adapters_only)
    assert (save_checkpoint(tmp_path / "adapters", state) / "manifest.json").is_file()


def test_unloaded_nf4_weights_are_found_without_dequantizing_the_model_at_once(monkeypatch):
    from foundry.convert import checkpoint_io
    from foundry.errors import CheckpointError

    model, trained = checkpoint_io.unloaded_model(QLORA_LLAMA), qlora_llama().state_dict()
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.Module, "state_dict", _state_dict_without_dequantizing(torch.nn.Module.state_dict))
        with pytest.raises(CheckpointError, match=r"left 2 weights of the model unloaded \(transformer\.blocks\.0"):
            checkpoint_io.check_weights_loaded(model, "it", ignore=lambda name: not name.endswith("Wqkv.weight"))
    model.load_state_dict(trained)
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.Module, "state_dict", _state_dict_without_dequantizing(torch.nn.Module.state_dict))
        checkpoint_io.check_weights_loaded(model, "it")


def _state_dict_without_dequantizing(state_dict):
    """``Module.state_dict`` that fails where it would dequantize every NF4 weight at once."""
    from foundry.models import lora

    def checked(module, *args, **kwargs):
        if any(map(is_nf4, module.parameters())) and not lora._NF4_KEPT_AS_CODES.get():
            raise AssertionError("the whole model's NF4 weights dequantized at once")
        return state_dict(module, *args, **kwargs)

    return checked


def test_merge_rounds_each_weight_as_it_goes_and_never_dequantizes_the_model_at_once(monkeypatch):
    from foundry.models.lora import merged_state_dict

    qlora = qlora_llama()
    monkeypatch.setattr(torch.nn.Module, "state_dict", _state_dict_without_dequantizing(torch.nn.Module.state_dict))
    merged = merged_state_dict(qlora, torch.bfloat16)
    layer = qlora.transformer.blocks[0].attn.Wqkv
    assert merged["transformer.blocks.0.attn.Wqkv.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["transformer.blocks.0.attn.Wqkv.weight"], layer.merged_weight().to(torch.bfloat16))
