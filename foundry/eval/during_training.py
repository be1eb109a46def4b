"""ICL evaluation during training: ``Trainer.eval`` scores the run's ``icl_tasks`` after its eval loaders.

Metrics are logged as ``metrics/icl/<label>/<num_fewshot>-shot/<metric>`` (``.../<category>/<metric>``
for categorised tasks) and gauntlet scores as ``metrics/icl/gauntlet/<category>``; they also land in
``state.eval_metrics`` under ``icl/<label>/<num_fewshot>-shot`` and ``icl/gauntlet``, where
early-stopping callbacks read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from foundry.core import Logger, State
from foundry.errors import ConfigError
from foundry.eval.config import EvalConfig
from foundry.eval.task_config import GauntletConfig, parse_gauntlet, parse_icl_tasks

if TYPE_CHECKING:  # torchmetrics (and the transformers it pulls in) load only for runs with icl_tasks
    from foundry.eval.evaluator import ICLEvaluator


def icl_refusal(tensor_parallel_degree: int) -> ConfigError:
    """The evaluator gives each rank its own batches, but tensor-parallel ranks must run the same ones."""
    return ConfigError(
        f"'parallelism.tensor_parallel_degree' is {tensor_parallel_degree} but icl_tasks are set; ICL evaluation does "
        "not run under tensor parallelism yet. Remove icl_tasks (evaluate the checkpoint with `foundry eval`), or "
        "set the degree to 1."
    )


class ICLEvaluation:
    """Prepared ICL tasks (and their gauntlet) that score the model being trained."""

    def __init__(self, evaluator: ICLEvaluator, gauntlet: GauntletConfig | None = None) -> None:
        self.evaluator = evaluator
        self.gauntlet = gauntlet

    def run(self, state: State, logger: Logger) -> dict[str, dict[str, float]]:
        """Evaluate now; log and return ``{subtask: {metric: value}}``."""
        results = self.evaluator.evaluate(state.model, state.precision, state.device)
        metrics = {
            f"metrics/icl/{name}/{metric}": value
            for name, values in results.items()
            for metric, value in values.items()
        }
        for name, values in results.items():
            state.eval_metrics[f"icl/{name}"] = values
        if self.gauntlet is not None:
            from foundry.eval.gauntlet import gauntlet_scores

            sizes = {name: self.evaluator.num_examples(name) for name in results}
            scores = gauntlet_scores(self.gauntlet, results, sizes)
            state.eval_metrics["icl/gauntlet"] = scores
            metrics.update({f"metrics/icl/gauntlet/{name}": value for name, value in scores.items()})
        logger.log_metrics(metrics)
        return results


def build_icl_evaluation(
    config: EvalConfig, tokenizer: Any, model: Any, tensor_parallel_degree: int = 1
) -> ICLEvaluation | None:
    """The ``icl_tasks`` of ``config`` prepared for ``tokenizer``, or None when the run has none."""
    if config.icl_tasks is None:
        return None
    if tensor_parallel_degree > 1:
        raise icl_refusal(tensor_parallel_degree)
    if tokenizer is None:
        raise ConfigError(
            "'icl_tasks' is set but the run has no tokenizer to build prompts with: pass tokenizer= to the Trainer "
            "(a train dataloader with a .tokenizer also gives it)."
        )
    seq_len = config.icl_seq_len or getattr(getattr(model, "config", None), "max_seq_len", None)
    if not isinstance(seq_len, int):
        raise ConfigError("'icl_tasks' is set but no sequence length is known: set 'icl_seq_len' (e.g. 1024).")
    if config.device_eval_batch_size is None:
        raise ConfigError("'icl_tasks' is set, so 'device_eval_batch_size' is needed (rows per ICL forward, e.g. 16).")
    from foundry.eval.evaluator import ICLEvaluator

    evaluator = ICLEvaluator(parse_icl_tasks(config.icl_tasks), tokenizer, seq_len, config.device_eval_batch_size)
    gauntlet = parse_gauntlet(config.eval_gauntlet) if config.eval_gauntlet is not None else None
    return ICLEvaluation(evaluator, gauntlet)
