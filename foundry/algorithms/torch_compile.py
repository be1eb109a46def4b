"""Regional compile: ``torch.compile`` each transformer block (or, with ``scope: model``, the whole model).

Blocks of one model share their code, so dynamo compiles one block and reuses the graph for the
others: compile time is that of one block, not of the model (torchtitan's ``apply_compile``). It
happens at INIT, before FSDP2 shards the model, and compiles each block's ``forward`` in place:
the block keeps its parameter names (checkpoints are unchanged) and FSDP2's all-gather hooks, which
run around ``forward`` in ``Module.__call__``, stay outside the compiled graph, as torchtitan gets by
sharding the compiled block. Activation checkpointing wrapped around a block later recomputes
the compiled forward; selective checkpointing (``activation_checkpointing_keep_attention``) compiles
its wrapper instead (``foundry.distributed.activation_checkpoint``).

``scope: model`` compiles the model's whole training forward as one graph instead: fusions across
block boundaries (one block's residual add with the next block's norm) at the price of compiling
every block. On one H100 it is about a point of MFU faster than regional compile for MPT-125M and
MPT-1B (docs/PERFORMANCE.md). It is meant for runs without FSDP: under FSDP2 it trains to the same
losses (tested on 2 ranks) but dynamo has to work around each block's all-gather hooks, and its
speed there is unmeasured. Eval and generation forwards run the model eagerly under this scope:
their shapes vary from batch to batch, and a recompile per shape would cost more than it saves.

Compiling happens at the first call. If it fails (a dynamo or inductor error, a missing compiler),
every forward this algorithm compiled goes back to eager with one warning and the run continues;
the backward graph is lowered together with the forward where torch allows it, so a backward that
cannot compile falls back the same way. The first call's time (compile included) is logged as
``time/compile_s``; inductor caches what it compiled on disk, so a second run of the same model
compiles faster.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.exc import TorchDynamoException

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError
from foundry.schema import check_call_kwargs

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CompileScope = Literal["blocks", "model"]
log = logging.getLogger(__name__)


@registry.algorithms.register("torch_compile")
class TorchCompile(Algorithm):
    """Compile every transformer block (and, with ``compile_loss``, the loss) at INIT.

    Args:
        mode: ``torch.compile``'s mode; None is ``default``.
        fullgraph: fail instead of falling back to eager at a graph break.
        dynamic: compile for symbolic shapes; False specialises on each shape seen; None is torch's automatic
            dynamic shapes (a size that changes is recompiled once as a symbol). ``auto`` (default): None under
            expert parallelism, whose blocks receive other row counts at every step (specialised on each, they
            would recompile up to dynamo's limit and then run eagerly), else False.
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
        dynamic: bool | Literal["auto"] | None = "auto",
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
        self.compiled = CompiledForwards()
        self._compile_time_logged = False

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.BATCH_END and not self._compile_time_logged)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.BATCH_END:
            self._log_compile_time(logger)
            return
        if self.compile_kwargs["dynamic"] == "auto":
            self.compile_kwargs["dynamic"] = None if state.parallel_dims.ep > 1 else False
        if self.scope == "model":
            compile_forward(state.model, self.compile_kwargs, self.compiled, training_only=True)
        else:
            self._compile_blocks(state.model)
        if self.compile_loss:
            state.model.loss = self.compiled.wrap(state.model.loss, self.compile_kwargs)

    def _log_compile_time(self, logger: Logger) -> None:
        self._compile_time_logged = True
        if self.compiled.error is not None:
            return
        logger.log_metrics({"time/compile_s": self.compiled.first_call_s})
        logger.log_text(
            f"torch_compile ({self.scope}): the first forward took {self.compiled.first_call_s:.1f} s, compile "
            "included (inductor caches it for the next run; compile_config: false turns compiling off)."
        )

    def _compile_blocks(self, model: torch.nn.Module) -> None:
        blocks = blocks_of(model)
        if not blocks:
            raise ConfigError(
                f"algorithms.torch_compile found no transformer blocks in {type(model).__name__}: it compiles the "
                "blocks a model declares (parallel_blocks(), foundry.distributed.protocol.ParallelModel) or those "
                "Hugging Face's _no_split_modules name. Declare them on the model, or set scope: model."
            )
        for block in blocks:
            compile_forward(block, self.compile_kwargs, self.compiled)


def from_compile_config(
    setting: bool | str | dict[str, Any], device: torch.device, sharded: bool
) -> TorchCompile | None:
    """The top-level ``compile_config`` key as this algorithm, or None for an eager run.

    ``auto`` compiles on a GPU only (on a CPU compiling costs minutes and buys little); the scope is
    the whole model on an unsharded model, where it measured fastest, and each block under FSDP2
    (torchtitan's choice: the blocks' all-gather hooks stay outside the graphs). ``true`` compiles on
    every device, a mapping sets the algorithm's keys (``scope`` too) and compiles everywhere.
    """
    if setting is False or (setting == "auto" and device.type != "cuda"):
        return None
    keys = {"scope": "blocks" if sharded else "model", "compile_loss": True}
    if isinstance(setting, dict):
        keys.update(setting)
    return TorchCompile(**check_call_kwargs(TorchCompile, keys, "compile_config"))


def _check_inductor_options(options: dict[str, Any]) -> None:
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


def compile_forward(
    module: torch.nn.Module,
    compile_kwargs: dict[str, Any],
    compiled: CompiledForwards | None = None,
    training_only: bool = False,
) -> None:
    """Replace ``module.forward`` by its compiled form; hooks and parameter names are untouched.

    Args:
        compiled: the group the forward joins: a compiler error in any of them sends all back to eager.
        training_only: compile only forwards in training mode; eval forwards run eagerly.
    """
    eager = module.forward
    group = compiled or CompiledForwards()
    wrapped = group.wrap(eager, compile_kwargs)
    module.foundry_compiled = True  # read by is_compiled
    if not training_only:
        module.forward = wrapped
        # How to compile a wrapper around this module instead (selective activation checkpointing).
        module.foundry_eager_forward = eager
        module.foundry_compile = functools.partial(group.wrap, compile_kwargs=compile_kwargs)
        return

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs) if module.training else eager(*args, **kwargs)

    module.forward = forward


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether training forwards of ``model`` run compiled: the whole model or its blocks, by this algorithm or
    by ``torch.compile`` (an ``OptimizedModule``)."""
    modules = [model, *blocks_of(model)]
    return any(getattr(module, "foundry_compiled", False) or hasattr(module, "_orig_mod") for module in modules)


class CompiledForwards:
    """Functions compiled together: timed on their first call, and all eager again after a compiler error."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.first_call_s = 0.0  # summed over each function's first call: compile plus one run

    def wrap(self, eager: Callable[..., Any], compile_kwargs: dict[str, Any]) -> Callable[..., Any]:
        """``eager`` compiled with ``torch.compile(**compile_kwargs)``, guarded by this group's fallback."""
        compiled = torch.compile(eager, **compile_kwargs)
        first_call = True

        @functools.wraps(eager)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal first_call
            if self.error is not None:
                return eager(*args, **kwargs)
            started_s = time.perf_counter()
            try:
                with _backward_lowered_with_forward():
                    result = compiled(*args, **kwargs)
            except TorchDynamoException as error:
                if _out_of_memory_cause(error) is not None:  # the caller (e.g. microbatch search) handles it
                    raise _out_of_memory_cause(error) from error
                if _in_checkpointed_forward():
                    self.error = error
                    raise _checkpointed_failure(error) from error
                self._fall_back(error)
                return eager(*args, **kwargs)
            if first_call:
                first_call = False
                self.first_call_s += time.perf_counter() - started_s
            return result

        return call

    def _fall_back(self, error: BaseException) -> None:
        self.error = error
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warnings.warn(
            f"torch.compile failed ({type(error).__name__}: {first_line}); the run continues with the eager "
            "model, which is slower. Set compile_config: false (or drop algorithms.torch_compile) to skip "
            "compiling; TORCH_LOGS=+dynamo shows why it failed.",
            stacklevel=3,
        )
        log.debug("torch.compile failure", exc_info=error)


def _in_checkpointed_forward() -> bool:
    """Whether this forward runs inside non-reentrant activation checkpointing (its saved-tensor hooks are on top)."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top_hooks(False) if top_hooks is not None else None
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def _checkpointed_failure(error: BaseException) -> ConfigError:
    """Why a compiler error inside a checkpointed block stops the run: the part of the block that ran compiled
    before the error saved tensors in the checkpoint, an eager re-run would save them again, and backward's
    recomputation (eager only) would not match them."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ConfigError(
        f"torch.compile failed inside an activation-checkpointed block ({type(error).__name__}: {first_line}), "
        "where the run cannot fall back to eager: the checkpoint already holds what the compiled part saved. "
        "Set compile_config: false (or drop algorithms.torch_compile) to train this model eagerly with "
        "checkpointing, or fsdp_config.activation_checkpointing: false to keep compile; TORCH_LOGS=+dynamo "
        "shows why it failed."
    )


@contextlib.contextmanager
def _backward_lowered_with_forward() -> Iterator[None]:
    """Compile the backward graph at the first forward (where this torch can), so its failure is caught there."""
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


def _out_of_memory_cause(error: BaseException) -> torch.OutOfMemoryError | None:
    """The out-of-memory error behind a compiler error (inductor's autotuning can run out of memory)."""
    cause = error.__cause__ or error.__context__
    while cause is not None:
        if isinstance(cause, torch.OutOfMemoryError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def compile_algorithm(
    setting: bool | str | dict[str, Any], algorithms: Sequence[Any], device: torch.device, sharded: bool
) -> list[TorchCompile]:
    """What a run's ``compile_config`` adds to ``algorithms``: one ``TorchCompile``, or nothing.

    Nothing when the run is eager, or when ``algorithms`` has a ``TorchCompile`` of its own (which then
    configures compilation; a ``compile_config`` other than ``auto`` beside it is a contradiction).
    """
    if any(isinstance(algorithm, TorchCompile) for algorithm in algorithms):
        if setting != "auto":
            raise ConfigError(
                f"compile_config is {setting!r} and a torch_compile algorithm is given: both configure torch.compile. "
                "Keep one (compile_config: false with algorithms.torch_compile is a contradiction)."
            )
        return []
    algorithm = from_compile_config(setting, device, sharded)
    return [algorithm] if algorithm is not None else []
