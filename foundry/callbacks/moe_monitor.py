"""How evenly each mixture-of-experts layer spreads its tokens over its experts."""

from __future__ import annotations

import torch

from foundry import distributed, registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.models.moe import expert_load, moe_layers


@registry.callbacks.register("moe_monitor")
class MoEMonitor(Callback):
    """Logs ``moe/layer_<i>/max_load`` and ``moe/max_load`` at every BATCH_END.

    A layer's load is the most tokens any expert received over the mean per expert, counted over the
    batch's microbatches on all ranks: 1 is a perfect balance, ``num_experts`` every token on one
    expert. ``moe/max_load`` is the worst layer's. A model without MoE layers logs nothing.
    """

    def batch_end(self, state: State, logger: Logger) -> None:
        layers = [layer for layer in moe_layers(state.model) if layer.assignments_since_read is not None]
        if not layers:
            return
        counts = torch.stack([layer.assignments_since_read for layer in layers])  # (layers, experts)
        counts = distributed.all_reduce_sum(counts.float())
        for layer in layers:
            layer.assignments_since_read = None
        loads = torch.stack([expert_load(layer_counts) for layer_counts in counts])
        metrics = {f"moe/layer_{index}/max_load": load for index, load in enumerate(loads)}
        logger.log_metrics({**metrics, "moe/max_load": loads.max()})
