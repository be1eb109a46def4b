"""An LLM Foundry run continued in foundry computes what LLM Foundry computes (fp32, CPU).

The fixtures in ``tests/fixtures/llmfoundry/`` were written by LLM Foundry 0.22 itself
(``make_llmfoundry_fixtures.py`` beside them): its pretraining YAML ``run.yaml`` trained 8 batches of a
tiny MPT, the Composer checkpoint it wrote after batch 4, and the LR and loss of every batch, from
scratch and in LLM Foundry's own resume from that checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from foundry.cli import main
from foundry.eval.loading import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmfoundry"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
LR_METRIC = "lr-DecoupledAdamW/group0"


def _run_yaml(tmp_path: Path) -> Path:
    text = (FIXTURES / "run.yaml").read_text()
    text = text.replace("DATA_DIR", str(FIXTURES / "data")).replace("TOKENIZER_DIR", str(FIXTURES / "tokenizer"))
    path = tmp_path / "run.yaml"
    path.write_text(text.replace("SAVE_FOLDER", str(tmp_path / "ckpt")))
    return path


def _train(tmp_path: Path, *overrides: str) -> dict[str, list[float]]:
    """Train LLM Foundry's YAML with foundry; the metrics of every batch."""
    pytest.importorskip("streaming", reason="the YAML's MDS data needs mosaicml-streaming")
    assert main(["train", str(_run_yaml(tmp_path)), f"run_folder={tmp_path / 'run'}", *overrides]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {name: [row[name] for row in rows if name in row] for name in (LR_METRIC, "loss/train/total")}


def test_llm_foundrys_yaml_trains_each_batch_at_the_lr_llm_foundry_gave_it(tmp_path):
    metrics = _train(tmp_path)
    assert metrics[LR_METRIC] == [batch["lr_logged"] for batch in EXPECTED["from_scratch"]]


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    """LLM Foundry's batch-4 checkpoint converted with its optimizer, schedule and data position."""
    out = tmp_path / "converted"
    assert main(["convert", "from-composer", str(FIXTURES / "ep0-ba4-rank0.pt"), str(out), "--with-optimizer"]) == 0
    return out


def test_a_run_resumed_from_llm_foundrys_checkpoint_has_llm_foundrys_resumed_losses(tmp_path, converted):
    metrics = _train(tmp_path, f"load_path={converted}")
    resumed = EXPECTED["resumed"]
    assert [batch["batch"] for batch in resumed] == [4, 5, 6, 7]
    assert metrics[LR_METRIC] == [batch["lr_logged"] for batch in resumed]
    # The same sums in another order (foundry's attention and loss kernels) round the last bits apart.
    assert metrics["loss/train/total"] == pytest.approx([batch["loss"] for batch in resumed], rel=1e-6)


def test_the_converted_checkpoint_carries_the_tokenizer_llm_foundry_stored(converted):
    from transformers import AutoTokenizer

    loaded = load_model(converted)
    original = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer")
    text = "12 + 30 = 42\n"
    assert loaded.tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert (loaded.tokenizer.eos_token, loaded.tokenizer.pad_token) == (original.eos_token, original.pad_token)


def test_from_hf_converts_llm_foundrys_mpt_export_with_its_logits(tmp_path):
    assert main(["convert", "from-hf", str(FIXTURES / "hf_export"), str(tmp_path / "ckpt")]) == 0
    loaded = load_model(tmp_path / "ckpt")
    expected = EXPECTED["export_logits"]
    with torch.no_grad():
        logits = loaded.model({"input_ids": torch.tensor(expected["input_ids"])})
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-6)
