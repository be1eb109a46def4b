"""Selective activation checkpointing as an algorithm: per block, per module type, or both.

Deprecated: ``fsdp_config.activation_checkpointing`` (LLM Foundry's switch, which also applies on one
device, where FSDP is skipped) with ``model.activation_checkpointing_target`` does the same through
``foundry.distributed.activation_checkpoint.apply_activation_checkpointing``, with the same ``target``
syntax. This algorithm keeps working and warns once; turning both on is a ConfigError, since a module
cannot be checkpointed twice.

Examples (``algorithms.activation_checkpointing``)::

    {}                                  # every block
    {target: {mptblock: first-8}}       # the first 8 blocks whole
    {target: [attention]}               # only attention, in every block
    {target: {mlp: [0, 2, 4]}}          # only the MLP of blocks 0, 2 and 4
"""

from __future__ import annotations

from typing import Any

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.deprecation import warn_deprecated
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing
from foundry.distributed.config import FSDP_DEFAULTS
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError


@registry.algorithms.register("activation_checkpointing")
class ActivationCheckpointing(Algorithm):
    """Checkpoint the ``target`` modules of the transformer blocks at INIT (before sharding).

    Args:
        target: ``None`` (every block), a class name or list of names (those modules in every
            block), or ``{name: blocks}`` with ``blocks`` as ``n``, ``-1``, a list of ids, or
            ``first-n`` / ``last-n`` / ``middle-n`` / ``range-i-j``.
        reentrant: torch's reentrant checkpoint (default: the non-reentrant one, as
            ``fsdp_config.activation_checkpointing_reentrant``'s).
        keep_attention: keep the attention kernels' outputs, as
            ``fsdp_config.activation_checkpointing_keep_attention`` (non-reentrant only).
    """

    def __init__(
        self,
        target: Any = None,
        reentrant: bool = FSDP_DEFAULTS.activation_checkpointing_reentrant,
        keep_attention: bool = FSDP_DEFAULTS.activation_checkpointing_keep_attention,
    ) -> None:
        warn_deprecated(
            "algorithms.activation_checkpointing",
            "set fsdp_config.activation_checkpointing: true (it applies on one GPU too) and "
            "model.activation_checkpointing_target to choose the modules.",
        )
        if keep_attention and reentrant:
            raise ConfigError(
                "algorithms.activation_checkpointing has keep_attention: true and reentrant: true, but keeping the "
                "attention outputs needs torch's non-reentrant checkpoint. Set reentrant: false (the default)."
            )
        self.target = target
        self.reentrant = reentrant
        self.keep_attention = keep_attention

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        apply_activation_checkpointing(
            state.model, blocks_of(state.model), self.target, self.reentrant, self.keep_attention
        )
