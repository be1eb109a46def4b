"""ICL eval during training: a callback that runs an ``ICLEvaluator`` every ``interval`` and at the end.

``foundry train`` adds it when the YAML has ``icl_tasks`` (at ``eval_interval``). Metrics are logged as
``metrics/icl/<label>/<num_fewshot>-shot/<metric>`` (``.../<category>/<metric>`` for categorised tasks)
and gauntlet scores as ``metrics/icl/gauntlet/<category>``; they also land in ``state.eval_metrics``
under ``icl/<label>/<num_fewshot>-shot`` and ``icl/gauntlet``, where early-stopping callbacks read them.
"""

from __future__ import annotations

from foundry.config.icl import GauntletConfig
from foundry.core import Callback, Interval, Logger, State, Time
from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.gauntlet import gauntlet_scores


class ICLEval(Callback):
    """Evaluate ``evaluator``'s tasks on the model being trained.

    Args:
        evaluator: the prepared tasks.
        interval: how often (``'500ba'``, ``'1ep'``, ``'0.25dur'``); the run's last batch is always evaluated.
        gauntlet: averages the tasks into category scores when given.
        eval_first: also evaluate before the first batch.
    """

    def __init__(
        self,
        evaluator: ICLEvaluator,
        interval: str | int | Time,
        gauntlet: GauntletConfig | None = None,
        eval_first: bool = False,
    ) -> None:
        self.evaluator = evaluator
        self.interval = Interval(interval)
        self.gauntlet = gauntlet
        self.eval_first = eval_first
        self._last_batch: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.eval_first and state.timestamp.batch == 0:
            self.run(state, logger)

    def batch_start(self, state: State, logger: Logger) -> None:
        self.interval.mark(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state):
            self.run(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state, epoch_end=True):
            self.run(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._last_batch != state.timestamp.batch:
            self.run(state, logger)

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
            sizes = {name: self.evaluator.num_examples(name) for name in results}
            scores = gauntlet_scores(self.gauntlet, results, sizes)
            state.eval_metrics["icl/gauntlet"] = scores
            metrics.update({f"metrics/icl/gauntlet/{name}": value for name, value in scores.items()})
        logger.log_metrics(metrics)
        self._last_batch = state.timestamp.batch
        return results
