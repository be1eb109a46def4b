"""Run LayerNorm and RMSNorm in the autocast dtype instead of fp32 (LLM Foundry's LPLayerNorm).

Autocast runs ``layer_norm`` in fp32, so under amp_bf16 every norm reads and writes fp32
activations. The low-precision variants in ``foundry.models.layers`` are subclasses that only
change ``forward``: the swap changes each norm's class in place at INIT, before the model is
placed or sharded, keeping its parameters and their names (checkpoints load either way). Outside
autocast (fp32 runs, CPU) they compute exactly what the originals do.
"""

from __future__ import annotations

from torch import nn

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.models.layers import LowPrecisionLayerNorm, LowPrecisionRMSNorm, RMSNorm

# Exact class -> its low-precision subclass (subclasses of these, e.g. fused norms, are left alone).
LOW_PRECISION_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.LayerNorm: LowPrecisionLayerNorm,
    RMSNorm: LowPrecisionRMSNorm,
}


@registry.algorithms.register("low_precision_layernorm")
class LowPrecisionLayerNormAlgorithm(Algorithm):
    """Swap every ``nn.LayerNorm`` and foundry ``RMSNorm`` for its low-precision variant at INIT."""

    def __init__(self) -> None:
        self.num_swapped = 0

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self.num_swapped = to_low_precision_norms(state.model)
        logger.log_text(f"low_precision_layernorm: {self.num_swapped} norms run in the autocast dtype.")


def to_low_precision_norms(model: nn.Module) -> int:
    """Change the class of each swappable norm in ``model`` in place; returns how many changed."""
    swapped = 0
    for module in model.modules():
        low_precision = LOW_PRECISION_CLASSES.get(type(module))
        if low_precision is not None:
            module.__class__ = low_precision
            swapped += 1
    return swapped
