"""``reference: precomputed``: the starting model's log-probabilities, computed once and stored beside the data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.core import LoggerDestination
from foundry.data import builtin_corpus_documents, load_tokenizer, train_bpe_tokenizer
from foundry.data.preference import build_preference_dataloader
from foundry.errors import ConfigError, TrainingError
from foundry.models.mpt import MPTCausalLM
from foundry.preference import PreferenceConfig, PreferenceObjective, reference_cache
from foundry.trainer import Trainer


class Metrics(LoggerDestination):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.steps.append({k: float(v) for k, v in metrics.items() if k.startswith(("loss/", "rewards/"))})


@pytest.fixture
def pairs_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "pairs"
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=folder / "tokenizer")
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (1 + i % 3), "rejected": " no" * (1 + i % 4)} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


def train(
    folder: Path, run: Path, reference: str, batches: int = 4, packing_ratio: float | None = None, **settings: Any
) -> tuple[Trainer, Metrics]:
    loader = build_preference_dataloader(
        tokenizer=load_tokenizer(str(folder / "tokenizer")), device_batch_size=2,
        dataset={"hf_name": str(folder / "train.jsonl"), "max_seq_len": 32, "packing_ratio": packing_ratio},
    )  # fmt: skip
    torch.manual_seed(0)
    packed = {"learned_pos_emb": False, "attn_config": {"alibi": True, "attn_uses_sequence_id": True}}
    shape = {"d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 32, "vocab_size": 320, "no_bias": True}
    model = MPTCausalLM(**shape, **(packed if packing_ratio else {}))
    metrics = Metrics()
    trainer = Trainer(
        model, loader, f"{batches}ba", objective=PreferenceObjective(PreferenceConfig(reference=reference)),
        loggers=[metrics], run_folder=str(run), progress_bar=False, log_to_console=False, **settings,
    )  # fmt: skip
    trainer.fit()
    return trainer, metrics


def test_precomputed_reference_trains_as_a_frozen_copy_and_is_stored_beside_the_data(
    pairs_folder: Path, tmp_path: Path
) -> None:
    _, copied = train(pairs_folder, tmp_path / "copy", "copy")
    _, precomputed = train(pairs_folder, tmp_path / "precomputed", "precomputed")
    for copy_step, precomputed_step in zip(copied.steps, precomputed.steps, strict=True):
        for name, value in copy_step.items():
            assert precomputed_step[name] == pytest.approx(value, abs=1e-6), name
    assert len(list(pairs_folder.glob("reference-logps-*.pt"))) == 1


def test_packed_microbatches_with_fewer_pairs_than_the_batchs_widest_row_read_the_table(
    pairs_folder: Path, tmp_path: Path
) -> None:
    run = {"packing_ratio": 2.5, "batches": 2, "device_train_microbatch_size": 1}
    trainer, copied = train(pairs_folder, tmp_path / "copy", "copy", **run)
    assert any(len({len(row) for row in batch}) > 1 for batch in trainer.state.train_dataloader.epoch_batches(0))
    _, precomputed = train(pairs_folder, tmp_path / "precomputed", "precomputed", **run)
    for copy_step, precomputed_step in zip(copied.steps, precomputed.steps, strict=True):
        copy_step.pop("rewards/accuracies")  # rewards of about 1e-8 (policy = reference): their order is rounding's
        precomputed_step.pop("rewards/accuracies")
        assert precomputed_step == pytest.approx(copy_step, abs=1e-6)


def test_the_table_is_scored_in_eval_mode_and_training_goes_on_in_train_mode(
    pairs_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[bool] = []
    model_sequence_logps = reference_cache.model_sequence_logps

    def recording(model: torch.nn.Module, *args: Any) -> Any:
        modes.append(model.training)
        return model_sequence_logps(model, *args)

    monkeypatch.setattr(reference_cache, "model_sequence_logps", recording)
    trainer, _ = train(pairs_folder, tmp_path / "run", "precomputed", batches=1)
    assert modes == [False] * 4  # 8 pairs, 2 a forward
    assert trainer.state.model.training


def test_a_second_run_from_the_same_start_reads_the_stored_table(
    pairs_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(pairs_folder, tmp_path / "first", "precomputed", batches=1)

    def recompute(*args: Any) -> None:
        raise AssertionError("the stored table was computed again")

    monkeypatch.setattr(reference_cache, "_compute", recompute)
    train(pairs_folder, tmp_path / "second", "precomputed", batches=1)


def test_a_resumed_run_whose_table_is_gone_stops_naming_the_file(pairs_folder: Path, tmp_path: Path) -> None:
    checkpoints = {"save_folder": str(tmp_path / "checkpoints"), "autoresume": True}
    train(pairs_folder, tmp_path / "run", "precomputed", batches=2, **checkpoints)
    for table in pairs_folder.glob("reference-logps-*.pt"):
        table.unlink()
    with pytest.raises(TrainingError, match=r"resumes at batch 2 .*reference-logps-.*\.pt\) are gone"):
        train(pairs_folder, tmp_path / "run", "precomputed", batches=4, **checkpoints)


def test_a_python_run_with_eval_loaders_is_refused_naming_them(pairs_folder: Path, tmp_path: Path) -> None:
    """Eval pairs' indices would read the train pairs' table: a wrong reference, so no eval loader at all."""
    loader = build_preference_dataloader(
        tokenizer=load_tokenizer(str(pairs_folder / "tokenizer")), device_batch_size=2,
        dataset={"hf_name": str(pairs_folder / "train.jsonl"), "max_seq_len": 32},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"precomputed.*eval loaders \(eval\)"):
        train(pairs_folder, tmp_path / "run", "precomputed", batches=1, eval_dataloader=loader)
