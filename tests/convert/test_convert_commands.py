"""`foundry convert to-hf` / `from-hf`: real checkpoints in, loadable Hugging Face directories out, and back."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, flip_byte, token_batches

from foundry.cli import main
from foundry.convert import adapter_for_hf, choose_export
from foundry.convert.checkpoint_io import save_weights_checkpoint
from foundry.convert.commands import add_from_hf_arguments, add_to_hf_arguments, run_from_hf, run_to_hf
from foundry.errors import CheckpointError, ConfigError
from foundry.models.build import build_model
from foundry.trainer import Trainer

LLAMA_SECTION: dict[str, Any] = {"name": "llama_causal_lm", **TINY_LLAMA, "vocab_size": 320}  # covers the tokenizer


def to_hf(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_to_hf_arguments(parser)
    return run_to_hf(parser.parse_args([str(arg) for arg in argv]))


def from_hf(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_from_hf_arguments(parser)
    return run_from_hf(parser.parse_args([str(arg) for arg in argv]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, torch.nn.Module]:
    """(save_folder of a 1-step Llama run, that run's model after the step)."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = build_model(LLAMA_SECTION)
    config = {"model": LLAMA_SECTION, "tokenizer": {"name": str(tokenizer_dir)}}
    trainer = Trainer(
        model, token_batches(1, 2, vocab_size=320), max_duration="1ba", save_folder=str(root / "ckpt"),
        save_interval="1ba", run_folder=str(root / "run"), log_to_console=False, config=config, device="cpu",
    )  # fmt: skip
    trainer.fit()
    return root / "ckpt", model.eval()


@pytest.fixture(scope="module")
def exported(trained: tuple[Path, torch.nn.Module], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("export") / "hf"
    assert to_hf(trained[0], out_dir) == 0
    return out_dir


@torch.no_grad()
def test_export_of_a_trained_checkpoint_loads_in_transformers_with_the_same_logits(trained, exported) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(exported)
    input_ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    ours = trained[1]({"input_ids": input_ids})
    assert (hf_model(input_ids=input_ids).logits - ours).abs().max().item() < 1e-5


def test_export_writes_safetensors_and_the_checkpoints_tokenizer(exported, tokenizer_dir) -> None:
    assert (exported / "model.safetensors").is_file()
    written = json.loads((exported / "tokenizer.json").read_text())["model"]["vocab"]
    assert written == json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert not list(exported.parent.glob(".tmp-*"))  # the temporary directory was renamed into place


def test_export_loads_in_a_process_that_never_imports_foundry(exported) -> None:
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(exported)!r})\n"
        f"ids = AutoTokenizer.from_pretrained({str(exported)!r})('hello world', return_tensors='pt').input_ids\n"
        "assert torch.isfinite(model(input_ids=ids).logits).all()\n"
        "assert not any(name.split('.')[0] == 'foundry' for name in sys.modules), 'foundry was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_export_refuses_a_non_empty_out_dir_without_overwrite(trained, exported) -> None:
    with pytest.raises(ConfigError, match="--overwrite"):
        to_hf(trained[0], exported)


def test_bf16_export_writes_bf16_weights(trained, tmp_path) -> None:
    from safetensors import safe_open

    to_hf(trained[0], tmp_path / "hf", "--dtype", "bf16")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_from_hf_writes_a_checkpoint_that_load_weights_only_starts_from(trained, exported, tmp_path, capsys) -> None:
    assert from_hf(exported, tmp_path / "imported") == 0
    assert "load_path:" in capsys.readouterr().out
    trainer = Trainer(
        build_model(LLAMA_SECTION), token_batches(1, 2, vocab_size=320), max_duration="1ba",
        load_path=str(tmp_path / "imported"), load_weights_only=True, run_folder=str(tmp_path / "run"),
        log_to_console=False, device="cpu",
    )  # fmt: skip
    loaded, original = trainer.state.model.state_dict(), trained[1].state_dict()
    assert all(torch.equal(loaded[name], original[name]) for name in original)


def test_from_hf_saves_the_tokenizer_and_names_it_in_the_checkpoint_config(exported, tmp_path) -> None:
    from_hf(exported, tmp_path / "imported")
    meta = json.loads(next((tmp_path / "imported").glob("ep0-ba0/meta.json")).read_text())
    assert meta["config"]["tokenizer"]["name"] == str((tmp_path / "imported" / "tokenizer").resolve())
    assert meta["config"]["model"]["name"] == "llama_causal_lm"
    assert (tmp_path / "imported" / "tokenizer" / "tokenizer.json").is_file()


def test_mpt_checkpoint_exports_to_an_mpt_for_causal_lm(tmp_path, tokenizer_dir) -> None:
    from transformers import AutoModelForCausalLM

    section = {"name": "mpt_causal_lm", "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 320,
               "max_seq_len": 16, "no_bias": True, "learned_pos_emb": False,
               "attn_config": {"alibi": True}}  # fmt: skip
    model = build_model(section).eval()
    save_weights_checkpoint(model, tmp_path / "ckpt", {"model": section}, overwrite=False)
    to_hf(tmp_path / "ckpt", tmp_path / "hf", "--tokenizer", tokenizer_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    input_ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf_model(input_ids=input_ids).logits - model({"input_ids": input_ids})).abs().max().item() < 1e-5
    assert type(hf_model).__name__ == "MptForCausalLM"


def test_checkpoint_without_a_tokenizer_needs_the_tokenizer_flag(tmp_path) -> None:
    save_weights_checkpoint(build_model(LLAMA_SECTION), tmp_path / "ckpt", {"model": LLAMA_SECTION}, overwrite=False)
    with pytest.raises(ConfigError, match="--tokenizer"):
        to_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, tokenizer_dir) -> None:
    section = {**LLAMA_SECTION, "vocab_size": 96}  # the tokenizer has 300 tokens
    save_weights_checkpoint(build_model(section), tmp_path / "ckpt", {"model": section}, overwrite=False)
    with pytest.raises(ConfigError, match="300 tokens"):
        to_hf(tmp_path / "ckpt", tmp_path / "hf", "--tokenizer", tokenizer_dir)
    assert not (tmp_path / "hf").exists()


def test_unexportable_family_error_lists_the_families_and_hf_causal_lm() -> None:
    with pytest.raises(ConfigError, match="llama_causal_lm, mpt_causal_lm.*hf_causal_lm"):
        choose_export(build_model(LLAMA_SECTION), "hf_causal_lm")


def test_unimportable_model_type_error_lists_the_types_and_hf_causal_lm() -> None:
    supported = "dbrx, foundry_mpt, gpt2, llama, mixtral, mpt, olmoe, qwen3_moe"
    with pytest.raises(ConfigError, match=f"{supported}.*hf_causal_lm"):
        adapter_for_hf("opt")


def test_from_hf_refuses_a_checkpoint_that_needs_its_own_code_without_running_it(tmp_path) -> None:
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "x_custom", "auto_map": auto_map}))
    with pytest.raises(ConfigError, match="names its own modeling code.*hf_causal_lm.*trust_remote_code"):
        from_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_from_hf_of_a_hub_id_says_to_download_it_first_and_pass_the_folder(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    assert main(["convert", "from-hf", "meta-llama/Llama-3.2-1B", "out"]) == 2
    err = capsys.readouterr().err
    assert "'meta-llama/Llama-3.2-1B' reads as a Hugging Face Hub id" in err
    assert "from-hf reads a Hugging Face model directory on disk" in err
    assert "hf download meta-llama/Llama-3.2-1B --local-dir models/meta-llama/Llama-3.2-1B" in err
    assert "`foundry convert from-hf models/meta-llama/Llama-3.2-1B OUT`" in err and "config.json)" not in err


def test_from_hf_of_a_folder_without_config_json_lists_what_it_holds_and_where_a_model_is(tmp_path, capsys) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    assert main(["convert", "from-hf", str(tmp_path / "weights"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'weights'} has no config.json" in err and "(it holds model.safetensors)" in err
    assert "snapshots/<revision>/" in err and "Hub id" not in err


def test_from_hf_of_a_foundry_checkpoint_says_it_needs_no_conversion(trained, tmp_path, capsys) -> None:
    assert main(["convert", "from-hf", str(trained[0]), str(tmp_path / "out")]) == 2
    assert "is a foundry checkpoint (or a save_folder)" in capsys.readouterr().err


def test_export_configs_carry_the_tokenizers_special_token_ids(exported, tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    expected["pad_token_id"] = tokenizer.pad_token_id
    for name in ("config.json", "generation_config.json"):
        written = json.loads((exported / name).read_text())
        assert {key: written.get(key) for key in expected} == expected, name


def test_export_generates_with_the_docs_snippet_and_stops_at_the_tokenizers_eos(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(exported), AutoTokenizer.from_pretrained(exported)
    inputs = tokenizer("Once upon", return_tensors="pt")
    assert "token_type_ids" not in inputs
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[1] > inputs["input_ids"].shape[1]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_mpt_export_names_the_eos_token_and_evaluates_through_load_model(tmp_path, tokenizer_dir) -> None:
    import foundry

    section = {"name": "mpt_causal_lm", "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 320,
               "max_seq_len": 16, "no_bias": True, "learned_pos_emb": False,
               "attn_config": {"alibi": True}}  # fmt: skip
    torch.manual_seed(0)
    save_weights_checkpoint(build_model(section), tmp_path / "ckpt", {"model": section}, overwrite=False)
    to_hf(tmp_path / "ckpt", tmp_path / "hf", "--tokenizer", tokenizer_dir)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    model, tokenizer = foundry.load_model(tmp_path / "hf")  # MptForCausalLM has no SDPA: eager is chosen
    assert model.hf_config._attn_implementation == "eager"
    assert isinstance(foundry.generate(model, tokenizer, "def", max_new_tokens=3), str)


def test_to_hf_on_a_lora_checkpoint_points_to_merge_and_export_adapter(tmp_path, tokenizer_dir) -> None:
    section = {**LLAMA_SECTION, "peft_config": {"r": 2, "target_modules": ["Wqkv"]}}
    config = {"model": section, "tokenizer": {"name": str(tokenizer_dir)}}
    save_weights_checkpoint(build_model(section), tmp_path / "ckpt", config, overwrite=False)
    with pytest.raises(ConfigError, match="convert merge.*export-adapter"):
        to_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_to_hf_of_a_damaged_checkpoint_names_the_file_and_writes_nothing(trained, tmp_path, capsys) -> None:
    save_folder = tmp_path / "ckpt"
    shutil.copytree(trained[0], save_folder)
    flip_byte(next(save_folder.glob("ep*/__0_0.distcp")))
    assert main(["convert", "to-hf", str(save_folder), str(tmp_path / "hf")]) == 2
    assert "is damaged: __0_0.distcp differs from its checksum" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("content", ["code", "garbage"])
def test_from_hf_refuses_a_hostile_or_damaged_bin_naming_the_file(exported, tmp_path, content) -> None:
    hf_dir = tmp_path / "hf"
    shutil.copytree(exported, hf_dir)
    (hf_dir / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(_RunsCommand(f"touch {marker}")) if content == "code" else b"\x80\x04garbage"
    (hf_dir / "pytorch_model.bin").write_bytes(hostile)
    with pytest.raises(CheckpointError, match=rf"Cannot read the weights in {hf_dir}.*pytorch_model.bin"):
        from_hf(hf_dir, tmp_path / "ckpt")
    assert not marker.exists()
