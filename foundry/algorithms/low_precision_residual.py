"""Run the residual stream in the autocast dtype, as FSDP's ``mixed_precision: PURE`` does.

Under autocast with fp32 parameters, an ``nn.Embedding`` lookup returns fp32, so every residual
add after it (``x + attn(...)``, ``x + ffn(...)``) promotes to fp32: each block reads and writes
its (tokens, d_model) activations and their gradients at twice the width of the bf16 GEMMs that
produce them. With FSDP ``mixed_precision: PURE`` the parameters are bf16 during compute, so the
lookup, and with it the whole residual stream, is bf16. This algorithm gives a run without FSDP
(one device, or CPU runs) the same activation precision: at INIT it hooks every
``nn.Embedding`` so its output is cast to the autocast dtype. Parameters, optimizer state and
gradients stay fp32; outside autocast (fp32 runs) the hook does nothing. A YAML's ``fsdp_config`` with
``mixed_precision: PURE`` or ``DEFAULT`` turns the same hook on by itself when the run has one rank and
FSDP is skipped (``foundry.distributed.fsdp``).
"""

from __future__ import annotations

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.precision import cast_embeddings_to_autocast_dtype
from foundry.core.state import State


@registry.algorithms.register("low_precision_residual")
class LowPrecisionResidual(Algorithm):
    """Cast each ``nn.Embedding``'s output to the autocast dtype, so the residual stream runs in it."""

    def __init__(self) -> None:
        self.num_hooked = 0

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self.num_hooked = cast_embeddings_to_autocast_dtype(state.model)
        logger.log_text(f"low_precision_residual: {self.num_hooked} embeddings return the autocast dtype.")
