"""One model through the ICL tasks: its evaluator (tasks tokenized at its sequence length) and its scores.

Shared by ``foundry eval`` (one model, or several with --compare) and adapter evaluation (one base, its
adapters switched in place). ``cfg`` is an ``EvalConfig`` (foundry.eval_command).
"""

from __future__ import annotations

import sys
from typing import Any

from foundry import distributed
from foundry.errors import ConfigError
from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.gauntlet import gauntlet_scores
from foundry.eval.loading import require_tokenizer
from foundry.eval.report import ModelResults

DEFAULT_SEQ_LEN = 2048  # when neither the config nor the model says


def build_evaluator(loaded: Any, tasks: list, cfg: Any) -> Any:
    """The tasks tokenized for ``loaded`` (a ``LoadedModel``) at the configured sequence length."""
    seq_len = cfg.icl_seq_len or cfg.max_seq_len or loaded.max_seq_len or DEFAULT_SEQ_LEN
    if loaded.max_seq_len is not None and seq_len > loaded.max_seq_len:
        raise ConfigError(
            f"icl_seq_len {seq_len} exceeds {loaded.name}'s max_seq_len {loaded.max_seq_len}; lower --seq-len."
        )
    tokenizer = require_tokenizer(loaded, "be evaluated on text")
    return ICLEvaluator(tasks, tokenizer, seq_len, cfg.device_eval_batch_size, cfg.max_examples)


def score(evaluator: Any, model: Any, name: str, gauntlet: Any, cfg: Any, device: Any) -> Any:
    """``ModelResults`` of ``model`` (already on ``device``) on every task, and the gauntlet if any."""
    show_progress = cfg.progress_bar and distributed.get_rank() == 0
    if show_progress:
        print(f"foundry: evaluating {name} on {len(evaluator.names)} ICL subtasks", file=sys.stderr)
    results = evaluator.evaluate(model, cfg.precision, device, progress=show_progress)
    sizes = {task: evaluator.num_examples(task) for task in results}
    scores = gauntlet_scores(gauntlet, results, sizes) if gauntlet is not None else {}
    return ModelResults(name, results, scores, sizes)
