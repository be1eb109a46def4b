"""benchmarks/float8_loss.py's comparison, data and command plumbing, on synthetic curves (no training)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import float8_loss


def write_variant(folder: Path, name: str, losses: dict[int, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    result = {"variant": name, "environment": {"device": "NVIDIA H100 80GB HBM3"}, "losses": losses}
    (folder / f"float8_loss_{name}.json").write_text(json.dumps(result))  # JSON keys become strings


def curve(offset: float, batches: int = 10) -> dict[int, float]:
    return {step: 10.0 - 0.5 * step + offset * (-1) ** step for step in range(1, batches + 1)}


def test_float8_within_the_bf16_spread_is_accepted_across_calls(tmp_path: Path) -> None:
    write_variant(tmp_path / "call1", "bf16", curve(0.0))
    write_variant(tmp_path / "call1", "float8", curve(0.01))
    write_variant(tmp_path / "call2", "bf16_again", curve(0.02))
    result = float8_loss.compare(float8_loss.load_variants([str(tmp_path / "call1"), str(tmp_path / "call2")]))
    assert result["within_bf16_spread"] == {"float8": {"bf16_again": True}}
    row = next(row for row in result["rows"] if row["variant"] == "float8")
    assert row["mean_abs_gap"] == pytest.approx(0.01) and row["common_batches"] == 10


def test_float8_is_judged_against_each_spread_run_on_its_own(tmp_path: Path) -> None:
    write_variant(tmp_path, "bf16", curve(0.0))
    write_variant(tmp_path, "bf16_again", curve(0.01))
    write_variant(tmp_path, "bf16_seed", curve(0.08))
    write_variant(tmp_path, "float8", curve(0.05))
    verdict = float8_loss.compare(float8_loss.load_variants([str(tmp_path)]))["within_bf16_spread"]
    assert verdict == {"float8": {"bf16_again": False, "bf16_seed": True}}


def test_a_cut_short_variant_is_compared_on_the_batches_it_logged(tmp_path: Path) -> None:
    write_variant(tmp_path, "bf16", curve(0.0))
    write_variant(tmp_path, "float8", {step: loss + 0.1 for step, loss in curve(0.0, batches=4).items()})
    result = float8_loss.compare(float8_loss.load_variants([str(tmp_path)]))
    row = next(row for row in result["rows"] if row["variant"] == "float8")
    assert row["common_batches"] == 4 and row["last_loss"] == pytest.approx(8.1)
    assert result["within_bf16_spread"] == {"float8": {}}  # no spread run: nothing decided


def test_float8_variants_add_the_algorithm_and_split_the_batch_over_the_ranks() -> None:
    args = argparse.Namespace(data="data/x", batches=300, global_batch=4, nproc=2, smoke=False)
    overrides = float8_loss.variant_overrides("float8", args)
    assert "algorithms.float8={}" in overrides and "device_train_microbatch_size=2" in overrides
    assert "algorithms.float8={}" not in float8_loss.variant_overrides("bf16_again", args)


def test_corpus_keeps_each_passage_once_and_skips_repeated_few_shot_files(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("plain corpus text")
    (tmp_path / "icl" / "task").mkdir(parents=True)
    passage = "a passage long enough to be kept as training text, " * 2
    rows = [{"query": passage, "choices": [passage, "short"], "gold": 1}, {"query": passage + "\u2028more"}]
    (tmp_path / "icl" / "task" / "qa.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "icl" / "task" / "gsm8k_prepended_8shot.jsonl").write_text(json.dumps({"q": "x" * 60}) + "\n")
    assert float8_loss.corpus_texts(tmp_path) == ["plain corpus text", passage, passage + "\u2028more"]


def test_plot_draws_the_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_variant(tmp_path, "bf16", curve(0.0))
    write_variant(tmp_path, "float8", curve(0.01))
    float8_loss.plot(float8_loss.load_variants([str(tmp_path)]), str(tmp_path / "curves.png"), "title")
    assert (tmp_path / "curves.png").stat().st_size > 1000
