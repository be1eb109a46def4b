"""Regional compile: ``torch.compile`` each transformer block, not the whole model.

Blocks of one model share their code, so dynamo compiles one block and reuses the graph for the
others: compile time is that of one block, not of the model (torchtitan's ``apply_compile``). It
happens at INIT, before FSDP2 shards the model, and compiles each block's ``forward`` in place:
the block keeps its parameter names (checkpoints are unchanged) and FSDP2's all-gather hooks, which
run around ``forward`` in ``Module.__call__``, stay outside the compiled graph, as torchtitan gets by
sharding the compiled block. Activation checkpointing wrapped around a block later recomputes
the compiled forward.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.distributed.parallelize import fsdp_blocks
from foundry.errors import ConfigError

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@registry.algorithms.register("torch_compile")
class TorchCompile(Algorithm):
    """Compile every transformer block (and, with ``compile_loss``, the loss) at INIT.

    Args:
        mode: ``torch.compile``'s mode; None is ``default``.
        fullgraph: fail instead of falling back to eager at a graph break.
        dynamic: compile for symbolic shapes; False (default) specialises on each shape seen.
        compile_loss: also compile ``model.loss`` (fuses the fp32 upcast into the cross-entropy).
        backend: ``inductor`` (default); ``aot_eager`` or ``eager`` trace without generating code
            (debugging, CPU tests).
    """

    def __init__(
        self,
        mode: CompileMode | None = None,
        fullgraph: bool = False,
        dynamic: bool = False,
        compile_loss: bool = False,
        backend: str = "inductor",
    ) -> None:
        self.compile_kwargs: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
        self.compile_kwargs["backend"] = backend
        self.compile_loss = compile_loss

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        blocks = fsdp_blocks(state.model)
        if not blocks:
            raise ConfigError(
                f"algorithms.torch_compile found no transformer blocks in {type(state.model).__name__} (it looks "
                "for model.transformer.blocks or Hugging Face's _no_split_modules). Define fsdp_wrap_modules() "
                "on the model to name them."
            )
        for block in blocks:
            compile_forward(block, self.compile_kwargs)
        if self.compile_loss:
            state.model.loss = torch.compile(state.model.loss, **self.compile_kwargs)


def compile_forward(module: torch.nn.Module, compile_kwargs: dict[str, Any]) -> None:
    """Replace ``module.forward`` by its compiled form; hooks and parameter names are untouched."""
    module.forward = torch.compile(module.forward, **compile_kwargs)
