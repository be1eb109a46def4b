"""Regional compile: ``torch.compile`` each transformer block (or, with ``scope: model``, the whole model).

Blocks of one model share their code, so dynamo compiles one block and reuses the graph for the
others: compile time is that of one block, not of the model (torchtitan's ``apply_compile``). It
happens at INIT, before FSDP2 shards the model, and compiles each block's ``forward`` in place:
the block keeps its parameter names (checkpoints are unchanged) and FSDP2's all-gather hooks, which
run around ``forward`` in ``Module.__call__``, stay outside the compiled graph, as torchtitan gets by
sharding the compiled block. Activation checkpointing wrapped around a block later recomputes
the compiled forward.

``scope: model`` compiles the model's whole forward as one graph instead: fusions across block
boundaries (one block's residual add with the next block's norm) at the price of compiling every
block. It is meant for runs without FSDP: under FSDP2 it trains to the same losses (tested on 2
ranks) but dynamo has to work around each block's all-gather hooks, and its speed there is unmeasured.
"""

from __future__ import annotations

import difflib
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
CompileScope = Literal["blocks", "model"]


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
        scope: ``blocks`` (default) compiles each transformer block; ``model`` the whole forward.
        options: inductor options, as ``torch.compile(options=...)`` takes them (e.g.
            ``{coordinate_descent_tuning: true}``); not together with ``mode``.
    """

    def __init__(
        self,
        mode: CompileMode | None = None,
        fullgraph: bool = False,
        dynamic: bool = False,
        compile_loss: bool = False,
        backend: str = "inductor",
        scope: CompileScope = "blocks",
        options: dict[str, Any] | None = None,
    ) -> None:
        if mode is not None and options is not None:
            raise ConfigError(
                f"algorithms.torch_compile has both mode ({mode!r}) and options; torch.compile takes one of the "
                "two. Drop mode and put the inductor settings you want in options, or drop options."
            )
        if options and backend == "inductor":
            _check_inductor_options(options)
        if scope not in CompileScope.__args__:
            raise ConfigError(f"algorithms.torch_compile.scope is {scope!r}; use 'blocks' or 'model'.")
        self.compile_kwargs: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
        self.compile_kwargs.update(backend=backend, options=options)
        self.compile_loss = compile_loss
        self.scope = scope

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if self.scope == "model":
            compile_forward(state.model, self.compile_kwargs)
        else:
            self._compile_blocks(state.model)
        if self.compile_loss:
            state.model.loss = torch.compile(state.model.loss, **self.compile_kwargs)

    def _compile_blocks(self, model: torch.nn.Module) -> None:
        blocks = fsdp_blocks(model)
        if not blocks:
            raise ConfigError(
                f"algorithms.torch_compile found no transformer blocks in {type(model).__name__} (it looks "
                "for model.transformer.blocks or Hugging Face's _no_split_modules). Define fsdp_wrap_modules() "
                "on the model to name them, or set scope: model."
            )
        for block in blocks:
            compile_forward(block, self.compile_kwargs)


def _check_inductor_options(options: dict[str, Any]) -> None:
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"algorithms.torch_compile.options has {key!r}, which this torch ({torch.__version__}) inductor does "
                f"not know.{hint} The names are those of torch._inductor.config, dotted for nested ones "
                "(triton.cudagraphs)."
            )


def compile_forward(module: torch.nn.Module, compile_kwargs: dict[str, Any]) -> None:
    """Replace ``module.forward`` by its compiled form; hooks and parameter names are untouched."""
    module.forward = torch.compile(module.forward, **compile_kwargs)
