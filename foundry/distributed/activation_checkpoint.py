"""Activation checkpointing: chosen modules keep only their inputs and recompute the rest in backward.

Which modules, as LLM Foundry's ``model.activation_checkpointing_target`` says:

- ``null`` or ``[]``: every block;
- a class name or a list of them (case-insensitive; LLM Foundry's ``grouped_query_attention``,
  ``mptmlp``... name foundry's ``Attention``, ``MLP``...): those modules, in every block;
- ``{name: blocks}``: those modules in the chosen blocks only; ``blocks`` is ``n`` (the first n),
  ``-1`` (all), a list of ids, or ``first-n``, ``last-n``, ``middle-n``, ``range-i-j`` (i included,
  j not), alone, in a list, or comma-separated.

A block whose own class is named is checkpointed whole, and the other names are ignored for it.

``keep_attention`` (``fsdp_config.activation_checkpointing_keep_attention``) makes the checkpoint selective
(torch's ``create_selective_checkpoint_contexts``, torchtitan's "op" SAC narrowed to attention): the outputs
of the attention kernels (``attention_kernel_ops``) are kept from the forward, everything else is recomputed.
Backward then reruns the projections, norms and MLP but not attention, which is about half of a step's
FLOPs at 64k tokens; the cost is the attention output (tokens x heads x head_dim x 2 bytes in bf16) and the
kernel's log-sum-exp per checkpointed module.

Selective checkpointing and regional compile (``algorithms.torch_compile``, which compiles each block's
forward in place at INIT, before this wrapper exists): the policy is a dispatch mode, and a dispatch mode
around compiled code does not see the ops inside it (torch 2.14 hands it the whole compiled region as one
``inductor_compiled_code`` op), so it cannot keep the attention there and backward recomputes it (tested).
The policy has to be traced into the graph instead, where AOTAutograd's partitioner honours it. So when
the module was compiled by ``algorithms.torch_compile``, its forward goes back to eager and the checkpoint
wrapper's forward is compiled in its place, the same way (same options, same fall-back-to-eager group):
the compiled region then holds the checkpoint, as in torchtitan, which compiles checkpointed blocks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from foundry.distributed import split_attention  # noqa: F401  (registers foundry.end_aligned_attention_forward)
from foundry.errors import ConfigError

_KEY = "model.activation_checkpointing_target"
# LLM Foundry's registry names for modules that foundry implements as one class each.
_ALIASES = {
    "multihead_attention": "attention",
    "grouped_query_attention": "attention",
    "multiquery_attention": "attention",
    "mptmlp": "mlp",
    "mptglu": "glu",
}


# The attention kernels foundry's layers dispatch (foundry.models.attention, distributed.context_parallel):
# SDPA's fused backends, its CPU flash kernel, other accelerators' fused SDPA, FlashAttention-4 (a custom
# op that exists once foundry.models is imported) and context parallelism's split route (a custom op that
# runs several kernels: kept whole, its merged output, not the pieces'). Looked up by name: an op this torch
# lacks is skipped.
_ATTENTION_OPS = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "foundry.flash_attention4_forward",
    "foundry.end_aligned_attention_forward",
)


def attention_kernel_ops() -> list[Any]:
    """The ops whose outputs ``keep_attention`` keeps: the kernels above and FlexAttention's operator."""
    ops: list[Any] = [torch._higher_order_ops.flex_attention]
    for name in _ATTENTION_OPS:
        namespace, _, op_name = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op_name, None)
        if packet is not None:
            ops.append(packet.default)
    return ops


def apply_activation_checkpointing(
    model: nn.Module, blocks: Sequence[nn.Module], target: Any, reentrant: bool, keep_attention: bool = False
) -> list[nn.Module]:
    """Wrap the targeted modules of ``blocks`` in place; returns the blocks as they now are (some wrapped).

    ``keep_attention``: keep the attention kernels' outputs (non-reentrant only; the config refuses reentrant).
    """
    if any(isinstance(module, CheckpointWrapper) for module in model.modules()):
        raise ConfigError(
            "Activation checkpointing is already applied to this model: algorithms.activation_checkpointing and "
            "fsdp_config.activation_checkpointing are both on. Keep one (they take the same target)."
        )
    plan = checkpoint_plan(blocks, target)
    for block_modules in plan:
        for module in block_modules:
            if keep_attention:
                wrapper = keep_attention_wrapper(module)
            elif reentrant:
                wrapper = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.REENTRANT)
            else:
                wrapper = checkpoint_wrapper(module, checkpoint_fn=checkpoint_closing_on_error, use_reentrant=False)
            replace_module(model, module, wrapper)
    return [checkpoint_wrapper_of(model, block) for block in blocks]


def checkpoint_closing_on_error(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint``, whose saved-tensor hooks are removed when the forward raises.

    Up to torch 2.11 a non-reentrant checkpoint whose forward raised left its hooks installed until the
    exception's traceback was freed: every later forward saved its tensors into the failed checkpoint, and the
    next backward stopped with "A different number of tensors was saved during the original forward and
    recomputation". foundry goes on after such errors (auto microbatching retries after running out of memory,
    the compile fall-back reruns a block eagerly), so it closes the checkpoint itself, as torch 2.14 does.
    """
    if torch.compiler.is_compiling():  # a compiled region's checkpoint: an error there ends the graph, not the run
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
    try:
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
    except BaseException as error:
        close_failed_checkpoints(error.__traceback__)
        raise


def close_failed_checkpoints(traceback: TracebackType | None) -> None:
    """Finish the checkpoint generators left suspended in ``traceback``'s frames (their hooks come off)."""
    checkpoint_file = inspect.getsourcefile(torch.utils.checkpoint)
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == "checkpoint" and frame.f_code.co_filename == checkpoint_file:
            generator = frame.f_locals.get("gen")
            if inspect.isgenerator(generator):
                generator.close()
        traceback = traceback.tb_next


def keep_attention_wrapper(module: nn.Module) -> nn.Module:
    """``module`` under a non-reentrant checkpoint that keeps the attention kernels' outputs.

    A module compiled by ``algorithms.torch_compile`` (which leaves ``foundry_compile``, the way it compiles,
    and ``foundry_eager_forward`` on it) runs eagerly inside the wrapper, and the wrapper's forward is compiled
    instead, so the policy is traced into the graph (module docstring).
    """
    context_fn = functools.partial(create_selective_checkpoint_contexts, attention_kernel_ops())
    wrapper = checkpoint_wrapper(
        module, checkpoint_fn=checkpoint_closing_on_error, use_reentrant=False, context_fn=context_fn
    )
    compile_forward = getattr(module, "foundry_compile", None)
    if compile_forward is not None:
        module.forward = module.foundry_eager_forward
        wrapper.forward = compile_forward(wrapper.forward)
    return wrapper


def apply_activation_offload(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Keep each block's saved activations in (pinned) host memory until backward needs them."""
    wrapped = []
    for block in blocks:
        offloaded = offload_wrapper(block)
        replace_module(model, block, offloaded)
        wrapped.append(offloaded)
    return wrapped


def checkpoint_plan(blocks: Sequence[nn.Module], target: Any) -> list[list[nn.Module]]:
    """For each block, the modules to checkpoint (the block itself, some of its submodules, or none)."""
    if target is None or target == []:
        return [[block] for block in blocks]
    if isinstance(target, str):
        target = [target]
    if isinstance(target, list):
        target = dict.fromkeys(target, -1)
    if not isinstance(target, dict):
        raise ConfigError(f"'{_KEY}' is {target!r}; give a class name, a list of names or {{name: blocks}}.")
    chosen: list[set[str]] = [set() for _ in blocks]
    for name, selection in target.items():
        for index in block_ids(selection, len(blocks)):
            chosen[index].add(_ALIASES.get(name.lower(), name.lower()))
    _check_names(blocks, {name for names in chosen for name in names})
    return [_modules_named(block, names) for block, names in zip(blocks, chosen)]


def block_ids(selection: Any, num_blocks: int) -> list[int]:
    """Block indices that LLM Foundry's target-block ``selection`` names (out-of-range ids are dropped)."""
    if selection == -1:
        return list(range(num_blocks))
    if isinstance(selection, int):
        return list(range(min(selection, num_blocks)))
    if isinstance(selection, str):
        selection = [part for part in selection.replace(" ", "").split(",") if part]
    if not isinstance(selection, list):
        raise ConfigError(f"'{_KEY}': block selection {selection!r} is not an int, a list or a string.")
    ids: set[int] = set()
    for item in selection:
        ids.update([item] if isinstance(item, int) else _parse_range(str(item), num_blocks))
    return sorted(i for i in ids if 0 <= i < num_blocks)


def _parse_range(text: str, num_blocks: int) -> range:
    kind, _, rest = text.partition("-")
    numbers = rest.split("-")
    if not all(number.isdigit() for number in numbers) or len(numbers) != (2 if kind == "range" else 1):
        raise ConfigError(f"'{_KEY}': cannot read {text!r}; use first-n, last-n, middle-n or range-i-j.")
    count = int(numbers[0])
    if kind == "first":
        return range(min(count, num_blocks))
    if kind == "last":
        return range(max(num_blocks - count, 0), num_blocks)
    if kind == "middle":
        start = max((num_blocks - 1) // 2 - count // 2, 0)
        return range(start, min(start + count, num_blocks))
    if kind == "range":
        return range(count, min(int(numbers[1]), num_blocks))
    raise ConfigError(f"'{_KEY}': cannot read {text!r}; use first-n, last-n, middle-n or range-i-j.")


def _modules_named(block: nn.Module, names: set[str]) -> list[nn.Module]:
    """The outermost modules of ``block`` whose class is in ``names`` (the block itself if it is)."""
    if type(block).__name__.lower() in names:
        return [block]
    found: dict[str, nn.Module] = {}
    for name, module in block.named_modules():
        inside_found = any(name.startswith(f"{outer}.") for outer in found)
        if type(module).__name__.lower() in names and not inside_found:
            found[name] = module
    return list(found.values())


def _check_names(blocks: Sequence[nn.Module], names: set[str]) -> None:
    known = {type(module).__name__.lower() for block in blocks for module in block.modules()}
    if unknown := sorted(names - known):
        raise ConfigError(
            f"'{_KEY}' names {unknown}, which no block holds. Modules in the blocks: {', '.join(sorted(known))}."
        )


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` sits inside ``root`` (a block in its ModuleList, a submodule in its block)."""
    for name, module in root.named_modules():
        if module is old:
            parent_name, _, child_name = name.rpartition(".")
            root.get_submodule(parent_name).register_module(child_name, new)
            return
    raise ValueError(f"{type(old).__name__} is not inside {type(root).__name__}.")


def checkpoint_wrapper_of(root: nn.Module, block: nn.Module) -> nn.Module:
    """``block``, or the wrapper that now stands in its place."""
    for module in root.modules():
        if getattr(module, "_checkpoint_wrapped_module", None) is block:
            return module
    return block
