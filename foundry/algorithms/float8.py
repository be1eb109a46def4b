"""Float8 training of the linear layers (``algorithms: {float8: {...}}``), through torchao.

On Hopper-class GPUs the float8 matrix units have twice the dense peak of bf16 ones. At INIT this
algorithm swaps the chosen ``nn.Linear`` layers for torchao's ``Float8Linear``: each forward and
backward GEMM casts its inputs to float8 with a fresh scale (``tensorwise``: one scale a tensor;
``rowwise``: one a row, more accurate and a little slower; ``rowwise_with_gw_hp``: rowwise, with the weight
gradient's GEMM kept in bf16; ``blockwise``: one scale per 1×128 tile of activations and gradients and per
128×128 tile of weights, DeepSeek-V3's recipe, through torchao's prototype kernels, Hopper only) and accumulates
in higher precision.
Weights, gradients and optimizer state keep their dtypes, so checkpoints are unchanged.

Which layers: every plain ``nn.Linear`` of the transformer blocks whose two dimensions are multiples
of 16 (the float8 GEMM's requirement; ``blockwise``: of 128), except the first and last
blocks (``keep_first_and_last_blocks``) and anything ``exclude`` names (fnmatch patterns over module
names, e.g. ``"*.ffn.down_proj"``). The output head, the embeddings and MoE routers stay in bf16, as do
LoRA layers (their frozen base included), which are not plain ``nn.Linear``. It runs before FSDP2 shards
the model (with ``fsdp_float8_all_gather`` and the tensorwise recipe, shards are all-gathered in float8,
half the bytes) and composes with ``torch_compile`` (which fuses the casts) and activation checkpointing.
MFU stays reported against the bf16 peak, as torchtitan does.

Each float8 GEMM input is scaled by its own amax first: a reduction over the tensor, then a cast,
two passes that compile fuses with the neighbouring elementwise work where it can. Without compile
they run as separate eager kernels (MPT-1B on an H100: 2.5x slower than bf16), so a run without
``torch_compile`` warns at FIT_START. Even compiled, those passes give back most of what the float8
GEMMs save at d_model 2048 (86% for MPT-1B, docs/PERFORMANCE.md): the gain grows with width.

Where float8 cannot run (a CPU, a GPU without float8 matrix units, no torchao installed) the algorithm
converts nothing and says so in one line at INIT: the run trains in bf16, so a YAML that ships float8
runs anywhere. torchao is an optional extra: ``pip install foundry[float8]``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import logging
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from foundry import registry
from foundry.algorithms.torch_compile import is_compiled
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.distributed.protocol import blocks_of
from foundry.errors import ConfigError
from foundry.models.nf4 import float8_refusal, is_nf4

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"]  # torchao's recipe names, and blockwise
FLOAT8_GEMM_MULTIPLE = 16
BLOCK = 128  # blockwise's tile: 1 x 128 for activations and gradients, 128 x 128 for weights
# An MoE router's scores choose each token's experts: rounding them to float8 changes the routing, not just the
# value (torchtitan keeps its routers in bf16 too). A tiny GEMM besides.
ALWAYS_BF16 = ("*.router.*",)
_KEY = "algorithms.float8"
log = logging.getLogger(__name__)


@registry.algorithms.register("float8")
class Float8Training(Algorithm):
    """Train the chosen linear layers with float8 GEMMs (torchao's ``convert_to_float8_training``).

    Args:
        recipe: ``tensorwise`` (the fastest), ``rowwise`` (finer scales), ``rowwise_with_gw_hp`` (rowwise,
            the weight gradient computed in bf16) or ``blockwise`` (a scale per tile; Hopper only).
        keep_first_and_last_blocks: leave the first and last transformer blocks in bf16 (they are the most
            sensitive to rounding).
        exclude: fnmatch patterns of module names that stay in bf16, on top of the defaults.
        fsdp_float8_all_gather: all-gather FSDP2 shards in float8 (tensorwise only).
    """

    def __init__(
        self,
        recipe: Recipe = "tensorwise",
        keep_first_and_last_blocks: bool = True,
        exclude: list[str] | None = None,
        fsdp_float8_all_gather: bool = True,
    ) -> None:
        if recipe not in Recipe.__args__:
            choices = ", ".join(repr(name) for name in Recipe.__args__)
            raise ConfigError(f"'{_KEY}.recipe' is {recipe!r}; it must be one of {choices}.")
        self.recipe = recipe
        self.keep_first_and_last_blocks = keep_first_and_last_blocks
        self.exclude = list(exclude or [])
        self.fsdp_float8_all_gather = fsdp_float8_all_gather and recipe == "tensorwise"
        self.converted: list[str] = []

    def match(self, event: Event, state: State) -> bool:
        if event == Event.AFTER_OPTIMIZER_STEP:
            return self._precomputes_scales(state)
        return event == Event.INIT or (event == Event.FIT_START and bool(self.converted))

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            if self._precomputes_scales(state):
                # before the first step too (a resumed run's as well): without a precomputed scale torchao takes
                # the amax over FSDP's ranks only, so under tensor parallelism each rank would scale its own part
                self._precompute_scales(state)
            if not is_compiled(state.model):
                log.warning(
                    "%s runs without torch.compile: each float8 cast (an amax reduction, then a scaled copy) runs "
                    "as its own eager kernel, which made MPT-1B 2.5x slower than bf16 on an H100. Leave "
                    "compile_config at auto (or add algorithms.torch_compile), or remove %s.",
                    _KEY,
                    _KEY,
                )
            return
        if event == Event.AFTER_OPTIMIZER_STEP:
            self._precompute_scales(state)
            return
        if any(is_nf4(parameter) for parameter in state.model.parameters()):
            raise float8_refusal()
        names = float8_module_names(state.model, self.keep_first_and_last_blocks, self.exclude, self.recipe)
        if not names:  # a setting the GPU run would refuse is refused on any device
            multiple = BLOCK if self.recipe == "blockwise" else FLOAT8_GEMM_MULTIPLE
            raise ConfigError(
                f"{_KEY} found no linear layer to convert (none in the transformer blocks is a plain nn.Linear "
                f"with sizes divisible by {multiple}, outside 'exclude' and the first and last blocks). Check "
                "'exclude' and keep_first_and_last_blocks, or remove the algorithm."
            )
        unavailable = float8_unavailable(state.device, self.recipe)
        if unavailable:
            logger.log_text(f"{_KEY}: {unavailable}; this run trains in bf16.")
            return
        self.converted = convert_to_float8(state.model, names, self.recipe, self.fsdp_float8_all_gather)
        logger.log_text(f"float8 ({self.recipe}): {len(self.converted)} linear layers train with float8 GEMMs.")

    @staticmethod
    def _precompute_scales(state: State) -> None:
        """Each float8-gathered weight's scale, from its whole tensor's amax (one all-reduce over every shard)."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(state.model)

    def _precomputes_scales(self, state: State) -> bool:
        return bool(self.converted) and self.fsdp_float8_all_gather and isinstance(state.model, FSDPModule)


def float8_module_names(
    model: nn.Module, keep_first_and_last_blocks: bool, exclude: list[str], recipe: str = "tensorwise"
) -> list[str]:
    """Names of the plain ``nn.Linear`` layers of the blocks that float8 can run, in model order."""
    multiple = BLOCK if recipe == "blockwise" else FLOAT8_GEMM_MULTIPLE
    blocks = blocks_of(model)
    if keep_first_and_last_blocks:
        blocks = blocks[1:-1]
    in_blocks = {id(module) for block in blocks for module in block.modules()}
    # A linear layer's subclass (LoRA's) computes its own way: neither it nor its adapters are swapped.
    in_linear_subclasses = {
        id(inner) for outer in model.modules() if isinstance(outer, nn.Linear) and type(outer) is not nn.Linear
        for inner in outer.modules()
    }  # fmt: skip
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or id(module) not in in_blocks or id(module) in in_linear_subclasses:
            continue
        if module.in_features % multiple or module.out_features % multiple:
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in (*ALWAYS_BF16, *exclude)):
            continue
        names.append(name)
    return names


def convert_to_float8(model: nn.Module, names: list[str], recipe: str, fsdp_float8_all_gather: bool) -> list[str]:
    """Swap the named layers for torchao's ``Float8Linear`` (or ``BlockwiseFloat8Linear``); returns the names."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            f"{_KEY} needs torchao, which is not installed: `pip install foundry[float8]` (or torchao)."
        ) from None
    if recipe == "blockwise":
        for name in names:
            BlockwiseFloat8Linear.convert(model.get_submodule(name))
        return names
    chosen = set(names)
    hints = {name: _init_hints(module) for name, module in model.named_modules() if name in chosen}
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)
    converted = [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
    for name in converted:  # a meta-device model is initialised after this: keep what init_weights reads
        vars(model.get_submodule(name)).update(hints[name])
    return converted


BLOCKWISE_UNDER_TP = (
    f"{_KEY}.recipe: blockwise, whose GEMMs (torchao's) take whole tensors, not the split weights (DTensors) tensor "
    "parallelism gives the layers. Use recipe: rowwise or tensorwise, which split with them, or set the degree to 1."
)


def blockwise_tensor_parallel_refusal(degree: int) -> ConfigError:
    return ConfigError(f"'parallelism.tensor_parallel_degree' is {degree} with {BLOCKWISE_UNDER_TP}")


class BlockwiseFloat8Linear(nn.Linear):
    """A linear layer whose three GEMMs run in float8 with a scale per tile (torchao's ``fp8_blockwise_mm``).

    Converted in place (the class changes, as FSDP2's ``fully_shard`` does), so the weight and the model's init
    hints stay; torchao's prototype ``Float8BlockwiseLinear`` refuses to be built off a Hopper GPU and keeps neither.
    Under autocast the inputs are cast to its dtype first, as ``F.linear``'s are; a bias is added after the GEMM.
    The weight gradient's GEMM contracts over the tokens in 128-token tiles, so a microbatch whose token count is no
    multiple of 128 (a finetuning batch padded to its longest row) gets zero rows to the next one, whose outputs
    are dropped and whose gradients are zero.
    """

    blockwise_mm: type  # torchao's autograd function, set by the first convert (torchao is an optional extra)
    tensor_parallel_refusal = BLOCKWISE_UNDER_TP  # apply_tensor_parallel says it for a Python Trainer's model

    @classmethod
    def convert(cls, linear: nn.Linear) -> None:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        cls.blockwise_mm = fp8_blockwise_mm
        linear.__class__ = cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, weight = x.dtype, self.weight
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:
            autocast_dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(autocast_dtype), weight.to(autocast_dtype)
        rows = x.reshape(-1, x.shape[-1])
        missing = -rows.shape[0] % BLOCK
        if missing:
            rows = torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])
        out = self.blockwise_mm.apply(rows.contiguous(), weight, BLOCK, torch.bfloat16, False)  # cuBLAS's GEMMs
        out = out[: out.shape[0] - missing].reshape(*x.shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if autocast else out.to(dtype)


def _blockwise_gemm_unavailable(device: torch.device) -> str | None:
    """Why this torch's cuBLAS cannot multiply blockwise-scaled float8 on ``device`` (one tiny GEMM), or None.

    torchao also has Triton GEMMs for it, but on torch 2.11 with Triton 3.6 inductor failed to compile them
    (1x H200, 2026-11-28), so a run without cuBLAS's trains in bf16 rather than crash mid-compile.
    """
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    x = torch.ones(BLOCK, BLOCK, device=device, dtype=torch.bfloat16)
    try:
        fp8_blockwise_mm.apply(x, x, BLOCK, torch.bfloat16, False)
    except Exception as error:  # any failure means the same: this torch cannot run the recipe
        return (
            "the blockwise recipe needs cuBLAS's blockwise-scaled float8 GEMM (torch 2.9 or newer, CUDA 12.9 or "
            f"newer), which failed here ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )
    return None


def _init_hints(linear: nn.Module) -> dict[str, object]:
    """The attributes a model set on one of its linear layers (``is_residual_output``, ``init_chunk_rows``, ...).

    ``Float8Linear.from_float`` builds a new module that keeps the weights but not these, and without
    them a model built on the meta device would be initialised differently once converted (residual
    projections not scaled down by depth, a fused QKV initialised as one matrix).
    """
    plain = vars(nn.Linear(1, 1, device="meta"))
    return {key: value for key, value in vars(linear).items() if key not in plain and not key.startswith("_")}


def float8_unavailable(device: torch.device, recipe: str = "tensorwise") -> str | None:
    """Why float8 (``recipe``) cannot train on ``device`` here, or None when it can.

    Float8 matrix units: NVIDIA compute capability 8.9+ (Ada, Hopper, Blackwell), AMD MI300 (gfx942, where
    torchao picks the e4m3fnuz/e5m2fnuz pair by itself) and MI350 (gfx950). torchao's blockwise kernels are
    written for Hopper: NVIDIA 9.0 and up.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.version.hip is not None:
            arch = torch.cuda.get_device_properties(device).gcnArchName
            found = None if "gfx94" in arch or "gfx95" in arch else f"an AMD {arch}"
        else:
            capability = torch.cuda.get_device_capability(device)
            name = torch.cuda.get_device_name(device)
            found = None if capability >= (8, 9) else f"a {name} (compute capability {capability[0]}.{capability[1]})"
    else:
        found = f"a {device.type} device"
    if found is not None:
        return (
            f"float8 needs a GPU with float8 matrix units (NVIDIA compute capability 8.9 or newer: L4, L40S, H100, "
            f"H200, B200; or AMD MI300/MI350), and this run is on {found}"
        )
    if recipe == "blockwise" and (torch.version.hip is not None or torch.cuda.get_device_capability(device) < (9, 0)):
        return (
            f"the blockwise recipe needs an NVIDIA GPU of compute capability 9.0 or newer (H100, H200, B200), and this "
            f"run is on a {torch.cuda.get_device_name(device)}; 'rowwise' runs on every float8 GPU"
        )
    if importlib.util.find_spec("torchao") is None:
        return "float8 needs torchao, which is not installed (`pip install foundry[float8]`)"
    return _blockwise_gemm_unavailable(device) if recipe == "blockwise" else None
