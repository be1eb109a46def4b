"""ICL eval during training: Trainer.eval scores icl_tasks at the eval interval and the end (metrics/icl/...)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TinyLM, token_batches

from foundry.core import LoggerDestination
from foundry.errors import ConfigError
from foundry.eval.metrics import MC_ACCURACY
from foundry.trainer import Trainer

ROWS = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)]
GAUNTLET = {"categories": [{"name": "c", "benchmarks": [{"name": "mc", "num_fewshot": 0, "random_baseline": 0.5}]}]}


class Recorder(LoggerDestination):
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, metrics))


def icl_trainer(tasks: list[dict], tokenizer: object, tmp_path: Path, loggers=(), **settings: object) -> Trainer:
    return Trainer(
        TinyLM(vocab_size=257),
        token_batches(5, 2, vocab_size=257),
        "5ba",
        loggers=loggers,
        tokenizer=tokenizer,
        icl_tasks=tasks,
        icl_seq_len=32,
        device_eval_batch_size=4,
        log_to_console=False,
        run_folder=str(tmp_path),
        **settings,
    )


def test_icl_metrics_are_logged_at_the_eval_interval_and_the_end(write_jsonl, byte_tokenizer, tmp_path: Path) -> None:
    tasks = [{"label": "mc", "dataset_uri": str(write_jsonl("mc.jsonl", ROWS)), "icl_task_type": "multiple_choice"}]
    recorder = Recorder()
    trainer = icl_trainer(tasks, byte_tokenizer, tmp_path, [recorder], eval_interval="2ba", eval_gauntlet=GAUNTLET)
    trainer.fit()
    steps = [step for step, metrics in recorder.logged if f"metrics/icl/mc/0-shot/{MC_ACCURACY}" in metrics]
    assert steps == [2, 4, 5]
    assert any("metrics/icl/gauntlet/average" in metrics for _, metrics in recorder.logged)
    assert set(trainer.state.eval_metrics) >= {"icl/mc/0-shot", "icl/gauntlet"}
    assert trainer.state.model.training  # eval hands the model back in train mode


def test_trainer_eval_scores_the_icl_tasks_when_called(write_jsonl, byte_tokenizer, tmp_path: Path) -> None:
    tasks = [{"label": "mc", "dataset_uri": str(write_jsonl("mc.jsonl", ROWS)), "icl_task_type": "multiple_choice"}]
    results = icl_trainer(tasks, byte_tokenizer, tmp_path).eval()
    assert MC_ACCURACY in results["icl/mc/0-shot"]


def test_icl_tasks_without_a_tokenizer_name_the_fix(write_jsonl, tmp_path: Path) -> None:
    tasks = [{"label": "mc", "dataset_uri": str(write_jsonl("mc.jsonl", ROWS)), "icl_task_type": "multiple_choice"}]
    with pytest.raises(ConfigError, match="pass tokenizer= to the Trainer"):
        icl_trainer(tasks, None, tmp_path)
