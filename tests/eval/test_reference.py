"""foundry eval --reference: a model's scores against reference scores from a file, with sampling noise."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry.cli import main
from foundry.errors import ConfigError
from foundry.eval.metrics import MC_ACCURACY
from foundry.eval.reference import (
    ReferenceModel,
    ReferenceScore,
    deltas,
    load_references,
    reference_table,
    verdict,
)
from foundry.eval.report import ModelResults
from foundry.eval.task_config import parse_icl_tasks


def write_references(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scores.yaml"
    path.write_text(text)
    return path


def test_a_delta_inside_two_standard_errors_is_within_noise() -> None:
    results = ModelResults("mine", {"copa/0-shot": {MC_ACCURACY: 0.60}}, num_examples={"copa/0-shot": 100})
    reference = ReferenceModel(model="ref", source="measured", scores=[
        ReferenceScore(task="copa/0-shot", metric=MC_ACCURACY, value=0.55)])  # fmt: skip
    (row,) = deltas(results, reference)
    assert row.delta == pytest.approx(0.05) and row.noise == pytest.approx(2 * (0.55 * 0.45 / 100) ** 0.5)
    assert row.within_noise  # 0.05 < 0.0995
    assert verdict([row]) == (True, "PASS: 1 of 1 accuracies within the noise.")


def test_a_delta_beyond_two_standard_errors_is_not_noise() -> None:
    results = ModelResults("mine", {"copa/0-shot": {MC_ACCURACY: 0.75}}, num_examples={"copa/0-shot": 400})
    reference = ReferenceModel(model="ref", source="measured", scores=[
        ReferenceScore(task="copa/0-shot", metric=MC_ACCURACY, value=0.55)])  # fmt: skip
    (row,) = deltas(results, reference)
    assert row.within_noise is False
    assert verdict([row]) == (False, "FAIL: 1 of 1 accuracies outside the noise: copa/0-shot.")
    assert "| copa/0-shot |" in reference_table(results, reference) and "no (±0.0497)" in reference_table(
        results, reference
    )


def test_tasks_the_model_did_not_run_are_left_out() -> None:
    results = ModelResults("mine", {"copa/0-shot": {MC_ACCURACY: 0.6}}, num_examples={"copa/0-shot": 100})
    reference = ReferenceModel(model="ref", source="measured", scores=[
        ReferenceScore(task="piqa/0-shot", metric=MC_ACCURACY, value=0.7)])  # fmt: skip
    assert deltas(results, reference) == []
    assert "(no task in common)" in reference_table(results, reference)
    assert verdict([])[0] is False  # nothing checked is no pass


def test_a_reference_without_a_source_is_refused(tmp_path) -> None:
    path = write_references(tmp_path, "references:\n- {model: m, source: '', scores: []}\n")
    with pytest.raises(ConfigError, match="empty source"):
        load_references(path)


def test_a_reference_file_without_references_names_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no top-level 'references:'"):
        load_references(write_references(tmp_path, "scores: []\n"))


def eval_against(reference_value: float, checkpoint: Path, tmp_path: Path, write_jsonl) -> int:
    """``foundry eval --reference`` of ``checkpoint`` on 6 two-choice rows against one reference accuracy."""
    rows = [{"query": f"Question {i}: pick", "choices": ["yes", "no"], "gold": i % 2} for i in range(6)]
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(
        f"icl_tasks:\n- {{label: mc, dataset_uri: '{write_jsonl('mc.jsonl', rows)}', icl_task_type: multiple_choice}}\n"
    )
    scores = write_references(
        tmp_path,
        f"references:\n- model: coin\n  source: a fair coin\n  scores:\n"
        f"  - {{task: mc/0-shot, metric: {MC_ACCURACY}, value: {reference_value}}}\n",
    )
    args = ["eval", "--model", str(checkpoint), "--tasks", str(tasks), "--reference", str(scores)]
    return main([*args, "--precision", "fp32"])


def test_foundry_eval_prints_the_comparison_and_passes(tiny_checkpoint, tmp_path, write_jsonl, capsys) -> None:
    assert eval_against(0.5, tiny_checkpoint, tmp_path, write_jsonl) == 0
    printed = capsys.readouterr().out
    assert "vs coin (a fair coin)" in printed and f"| mc/0-shot | {MC_ACCURACY} |" in printed
    assert "| 6 |" in printed  # the 6 examples scored set the noise
    assert printed.rstrip().endswith("PASS: 1 of 1 reference checks passed")


def test_foundry_eval_outside_the_noise_fails_and_exits_1(tiny_checkpoint, tmp_path, write_jsonl, capsys) -> None:
    assert eval_against(0.999, tiny_checkpoint, tmp_path, write_jsonl) == 1  # noise ±0.026: only 6 of 6 passes
    printed = capsys.readouterr().out
    assert "FAIL: 1 of 1 accuracies outside the noise: mc/0-shot." in printed
    assert printed.rstrip().endswith("FAIL: 0 of 1 reference checks passed")


def test_the_shipped_reference_scores_name_tasks_of_the_shipped_task_file() -> None:
    yamls = Path(__file__).resolve().parents[2] / "yamls" / "eval"
    (reference,) = load_references(yamls / "reference_scores.yaml")
    tasks = parse_icl_tasks(yamls / "tasks_zero_shot.yaml")
    names = {f"{task.label}/{shots}-shot" for task in tasks for shots in task.num_fewshot}
    assert reference.source and {score.task for score in reference.scores} == names
