"""Learning rate of every optimizer param group, as the scheduler set it for the next step."""

from __future__ import annotations

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State


@registry.callbacks.register("lr_monitor")
class LRMonitor(Callback):
    """Logs ``lr-<OptimizerClass>/group<i>`` at every BATCH_END.

    A second optimizer of the same class logs as ``lr-<OptimizerClass>_1/group<i>`` so none overwrites another.
    """

    def batch_end(self, state: State, logger: Logger) -> None:
        metrics = {}
        seen: dict[str, int] = {}
        for optimizer in state.optimizers:
            name = type(optimizer).__name__
            count = seen.get(name, 0)
            seen[name] = count + 1
            prefix = f"lr-{name}" if count == 0 else f"lr-{name}_{count}"
            for index, group in enumerate(optimizer.param_groups):
                metrics[f"{prefix}/group{index}"] = group["lr"]
        if metrics:
            logger.log_metrics(metrics)
