"""Without mosaicml-streaming or wandb (as in the GPU image) foundry imports and non-MDS data works.

One subprocess hides both packages, runs every check and prints a JSON report; each test reads one
entry of it, so the interpreter start is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import repo_pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]

WITHOUT_OPTIONAL_PACKAGES = """
import json, sys
sys.modules["streaming"] = None  # an import of streaming (or any streaming.*) now raises ImportError
sys.modules["wandb"] = None
tokenizer_dir, jsonl_path, mds_dir = sys.argv[1:4]
report = {}

import foundry, foundry.config.build, foundry.data, foundry.eval_command, foundry.loggers, foundry.trainer
from foundry import registry
from foundry.data import build_finetuning_dataloader, build_text_dataloader, load_tokenizer
from foundry.errors import FoundryError

report["dataloaders"] = list(registry.dataloaders)
tokenizer = load_tokenizer(tokenizer_dir)
loader = build_finetuning_dataloader(
    tokenizer=tokenizer, device_batch_size=2, dataset={"hf_name": jsonl_path, "max_seq_len": 16}
)
report["finetuning_batch_shape"] = list(next(iter(loader))["input_ids"].shape)

def error_of(build):
    try:
        build()
    except FoundryError as error:
        return str(error)
    return None

report["text_loader_error"] = error_of(
    lambda: build_text_dataloader(device_batch_size=2, dataset={"local": mds_dir, "max_seq_len": 16})
)
report["mds_finetuning_error"] = error_of(
    lambda: build_finetuning_dataloader(
        tokenizer=tokenizer, device_batch_size=2, dataset={"local": mds_dir, "split": "train", "max_seq_len": 16}
    )
)
report["lazy_class_error"] = error_of(lambda: foundry.data.TextDataLoader)
print(json.dumps(report))
"""


@pytest.fixture(scope="session")  # not rerun when a shuffled order leaves this module and comes back
def report(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the subprocess without streaming and wandb could and could not do."""
    folder = tmp_path_factory.mktemp("without_streaming")
    jsonl_path = folder / "train.jsonl"
    rows = [{"prompt": f"Question {index}?", "response": f" Answer {index}."} for index in range(4)]
    jsonl_path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    mds_dir = folder / "mds"  # never read: the missing package is reported before the folder is looked at
    process = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPTIONAL_PACKAGES, str(tiny_tokenizer_dir), str(jsonl_path), str(mds_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.splitlines()[-1])


def test_foundry_imports_and_registers_every_dataloader_without_streaming(report: dict[str, Any]) -> None:
    assert {"text", "finetuning"} <= set(report["dataloaders"])


def test_jsonl_finetuning_loader_yields_batches_without_streaming(report: dict[str, Any]) -> None:
    assert report["finetuning_batch_shape"] == [2, 16]


def test_text_loader_without_streaming_names_the_loader_and_the_install_command(report: dict[str, Any]) -> None:
    message = report["text_loader_error"]
    assert message is not None
    assert "'train_loader'" in message
    assert "pip install mosaicml-streaming" in message


def test_mds_finetuning_source_without_streaming_names_the_install_command(report: dict[str, Any]) -> None:
    message = report["mds_finetuning_error"]
    assert message is not None
    assert "finetuning dataloader" in message
    assert "pip install mosaicml-streaming" in message


def test_streaming_classes_of_foundry_data_load_lazily_with_a_clear_error(report: dict[str, Any]) -> None:
    message = report["lazy_class_error"]
    assert message is not None
    assert "foundry.data.TextDataLoader" in message
    assert "pip install mosaicml-streaming" in message
