"""ICL eval during training: at the interval and the end, logged under metrics/icl/, from a train YAML too."""

from __future__ import annotations

from pathlib import Path

from helpers import TinyLM, token_batches

from foundry.eval.task_config import parse_gauntlet, parse_icl_tasks
from foundry.core import LoggerDestination
from foundry.eval.callback import ICLEval
from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.metrics import MC_ACCURACY
from foundry.trainer import Trainer

ROWS = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)]
GAUNTLET = {"categories": [{"name": "c", "benchmarks": [{"name": "mc", "num_fewshot": 0, "random_baseline": 0.5}]}]}


class Recorder(LoggerDestination):
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, metrics))


def test_icl_metrics_are_logged_at_the_interval_and_the_end(write_jsonl, byte_tokenizer, tmp_path: Path) -> None:
    tasks = parse_icl_tasks(
        [{"label": "mc", "dataset_uri": str(write_jsonl("mc.jsonl", ROWS)), "icl_task_type": "multiple_choice"}]
    )
    callback = ICLEval(ICLEvaluator(tasks, byte_tokenizer, 32, 4), "2ba", parse_gauntlet(GAUNTLET))
    recorder = Recorder()
    trainer = Trainer(
        model=TinyLM(vocab_size=257),
        train_dataloader=token_batches(5, 2, vocab_size=257),
        max_duration="5ba",
        callbacks=[callback],
        loggers=[recorder],
        log_to_console=False,
        run_folder=str(tmp_path),
    )
    trainer.fit()
    steps = [step for step, metrics in recorder.logged if f"metrics/icl/mc/0-shot/{MC_ACCURACY}" in metrics]
    assert steps == [2, 4, 5]
    assert "metrics/icl/gauntlet/average" in recorder.logged[-1][1]
    assert set(trainer.state.eval_metrics) >= {"icl/mc/0-shot", "icl/gauntlet"}
    assert trainer.state.model.training  # eval hands the model back in train mode


def test_train_yaml_icl_tasks_become_the_callback(write_jsonl, tmp_path: Path) -> None:
    from foundry.builders import build_icl_eval
    from foundry.config import LoaderConfig, TokenizerConfig, TrainConfig
    from foundry.core import Time

    path = write_jsonl("mc.jsonl", ROWS)
    cfg = TrainConfig(
        model={"name": "mpt_causal_lm", "max_seq_len": 32},
        tokenizer=TokenizerConfig(name="unused"),
        train_loader=LoaderConfig(name="text"),
        optimizer={"name": "adamw"},
        max_duration=Time.parse("4ba"),
        eval_interval=Time.parse("2ba"),
        global_train_batch_size=2,
        device_eval_batch_size=4,
        icl_tasks=[{"label": "mc", "dataset_uri": str(path), "icl_task_type": "multiple_choice"}],
    )
    from helpers import ByteTokenizer

    (callback,) = build_icl_eval(cfg, ByteTokenizer())
    assert isinstance(callback, ICLEval) and callback.interval.every == cfg.eval_interval
    assert callback.evaluator.names == ["mc/0-shot"]
