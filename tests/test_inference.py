"""``foundry.load_model`` and ``foundry.generate``: a checkpoint, a save_folder or an HF export, as a model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from helpers import TINY_LLAMA

import foundry
from foundry.convert.checkpoint_io import save_weights_checkpoint
from foundry.data import builtin_corpus_documents, train_bpe_tokenizer
from foundry.models.build import build_model

SECTION = {"name": "llama_causal_lm", **TINY_LLAMA, "vocab_size": 320}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(a save_folder holding one checkpoint that names its tokenizer, the model saved there)."""
    root = tmp_path_factory.mktemp("inference")
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=root / "tokenizer")
    torch.manual_seed(0)
    model = build_model(SECTION)
    config = {"model": SECTION, "tokenizer": {"name": str(root / "tokenizer")}}
    save_weights_checkpoint(model, root / "ckpt", config, overwrite=False)
    return root / "ckpt", model


@pytest.fixture(scope="module")
def save_folder(saved: tuple[Path, torch.nn.Module]) -> Path:
    return saved[0]


def test_load_model_reads_a_save_folder_into_an_eval_mode_model_and_its_tokenizer(saved) -> None:
    model, tokenizer = foundry.load_model(saved[0])
    assert not model.training and len(tokenizer) <= 320
    for name, tensor in saved[1].state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_generate_writes_the_same_text_from_the_checkpoint_and_its_hf_export(save_folder, tmp_path) -> None:
    from foundry.convert.commands import add_to_hf_arguments, run_to_hf

    parser = argparse.ArgumentParser()
    add_to_hf_arguments(parser)
    run_to_hf(parser.parse_args([str(save_folder), str(tmp_path / "hf")]))
    prompts = ["The module", "def main"]
    ours = foundry.generate(*foundry.load_model(save_folder), prompts, max_new_tokens=6)
    theirs = foundry.generate(*foundry.load_model(tmp_path / "hf"), prompts, max_new_tokens=6)
    assert ours == theirs and all(isinstance(text, str) for text in ours)


def test_generate_cuts_the_text_at_a_stop_string(save_folder) -> None:
    model, tokenizer = foundry.load_model(save_folder)
    full = foundry.generate(model, tokenizer, "The", max_new_tokens=8)
    stop = full[2:4]
    assert stop and foundry.generate(model, tokenizer, "The", max_new_tokens=8, stop=[stop]) == full[: full.find(stop)]


@pytest.fixture(scope="module")
def tokenizerless(saved: tuple[Path, torch.nn.Module], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_folder whose run named no tokenizer (a Trainer fed pre-tokenized batches)."""
    root = tmp_path_factory.mktemp("no-tokenizer")
    save_weights_checkpoint(saved[1], root / "ckpt", {"model": SECTION}, overwrite=False)
    return root / "ckpt"


def test_load_model_opens_a_checkpoint_without_a_tokenizer_and_generate_asks_for_one(saved, tokenizerless) -> None:
    model, tokenizer = foundry.load_model(tokenizerless)
    assert tokenizer is None
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved[1].state_dict().items())
    with pytest.raises(foundry.ConfigError, match=r"needs the model's tokenizer.*load_model\(path, tokenizer="):
        foundry.generate(model, tokenizer, "The")


def test_load_model_takes_the_tokenizer_a_checkpoint_lacks(saved, tokenizerless) -> None:
    with_tokenizer = foundry.load_model(saved[0])
    model, tokenizer = foundry.load_model(tokenizerless, tokenizer=saved[0].parent / "tokenizer")
    assert foundry.generate(model, tokenizer, "The", max_new_tokens=4) == foundry.generate(
        *with_tokenizer, "The", max_new_tokens=4
    )


def test_evaluating_a_checkpoint_without_a_tokenizer_names_the_way_to_give_one(tokenizerless) -> None:
    from foundry.eval.loading import load_model, require_tokenizer

    with pytest.raises(foundry.ConfigError, match=r"has no tokenizer.*`foundry eval --tokenizer DIR_OR_NAME"):
        require_tokenizer(load_model(tokenizerless), "be evaluated on text")
