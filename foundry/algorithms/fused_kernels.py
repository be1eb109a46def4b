"""Swap a model's norms, RoPE, gated activations and loss for foundry's Triton kernels (``foundry/kernels``).

Applied at ``Event.INIT``, before the model is placed or sharded. The fused modules take over the
original ``weight``/``bias`` parameters under the same names, so the state dict and checkpoints are
unchanged: a checkpoint saved with the algorithm loads without it, and the other way round.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.precision import autocast_dtype
from foundry.core.state import State
from foundry.deprecation import warn_deprecated
from foundry.errors import ConfigError
from foundry.kernels.device import kernels_run_on
from foundry.models.attention import Attention
from foundry.models.layers import GLU, LowPrecisionLayerNorm, LowPrecisionRMSNorm, RMSNorm


class FusedNorm(nn.Module):
    """RMSNorm or LayerNorm through the Triton kernel; holds the replaced norm's own parameters.

    Always accumulates in fp32. ``low_precision`` norms (LLM Foundry's LP variants) return the
    autocast dtype, as theirs do, so the next GEMM reads half the bytes; the others return x's dtype.
    """

    takes_dtensors = False  # sequence parallelism's norms run on DTensors (foundry.distributed.tensor_parallel)

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.is_rms = isinstance(norm, RMSNorm)
        self.low_precision = isinstance(norm, LowPrecisionRMSNorm | LowPrecisionLayerNorm)
        self.eps = norm.eps
        self.weight = norm.weight
        if not self.is_rms:
            self.bias = norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from foundry.kernels.norm import layer_norm, rms_norm  # imports triton: only where the kernels run

        out_dtype = (autocast_dtype(x.device.type) if self.low_precision else None) or x.dtype
        if self.is_rms:
            return rms_norm(x, self.weight, self.eps, out_dtype)
        return layer_norm(x, self.weight, self.bias, self.eps, out_dtype)


def _is_fusable_norm(module: nn.Module) -> bool:
    if isinstance(module, RMSNorm):
        return True
    # Only affine LayerNorms over the last dim (all that foundry builds).
    return isinstance(module, nn.LayerNorm) and module.weight is not None and len(module.normalized_shape) == 1


def _swap_norms(model: nn.Module, want_rms: bool, want_layernorm: bool) -> int:
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_fusable_norm(child) and (want_rms if isinstance(child, RMSNorm) else want_layernorm):
                setattr(parent, name, FusedNorm(child))
                swapped += 1
    return swapped


@registry.algorithms.register("fused_kernels")
class FusedKernels(Algorithm):
    """Replace eager layers with foundry's Triton kernels; each switch is on by default.

    Args:
        rmsnorm: RMSNorm and low_precision_rmsnorm.
        layernorm: LayerNorm and low_precision_layernorm (with or without bias).
        rope: rotary embeddings of q and k.
        glu: ``act(gate) * up`` of the ``mptglu`` feed-forward (SwiGLU, GeGLU).
        cross_entropy: deprecated, a second switch for ``model.loss_fn``, which decides alone (``auto``
            fuses the output projection into the loss wherever its Triton kernel runs); ``True`` still
            forces ``fused_crossentropy``, with one warning.
        strict: fail instead of falling back to PyTorch where Triton cannot run (CPU).
    """

    def __init__(
        self,
        rmsnorm: bool = True,
        layernorm: bool = True,
        rope: bool = True,
        glu: bool = True,
        cross_entropy: bool | None = None,
        strict: bool = False,
    ) -> None:
        if cross_entropy is not None:
            warn_deprecated(
                "algorithms.fused_kernels.cross_entropy",
                "set model.loss_fn: fused_crossentropy (or torch_crossentropy); its default, auto, fuses the loss "
                "wherever the Triton kernel runs.",
            )
        self.switches = {"rmsnorm": rmsnorm, "layernorm": layernorm, "rope": rope, "glu": glu}
        self.cross_entropy = cross_entropy
        self.strict = strict
        self.swapped: dict[str, int] = {}

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if not kernels_run_on(state.device):
            message = (
                f"algorithms.fused_kernels: Triton kernels cannot run on {state.device.type} (they need a CUDA/ROCm "
                f"GPU, or TRITON_INTERPRET=1 on CPU); training uses the PyTorch layers."
            )
            if self.strict:
                raise ConfigError(f"{message} Remove 'strict: true' to fall back, or run on a GPU.")
            warnings.warn(message, stacklevel=2)
            return
        self.swapped = self.fuse(state.model)
        logger.log_text(f"fused_kernels: {', '.join(f'{n} {k}' for k, n in self.swapped.items())} swapped.")

    def fuse(self, model: nn.Module) -> dict[str, int]:
        """Swap the switched-on layers of ``model`` in place; returns how many of each were swapped."""
        # These import triton, which a CPU-only install may lack: only once the kernels are known to run.
        from foundry.kernels.glu import glu
        from foundry.kernels.rope import rope

        swapped = {"norms": _swap_norms(model, self.switches["rmsnorm"], self.switches["layernorm"])}
        swapped["rope"] = swapped["glu"] = 0
        for module in model.modules():
            if self.switches["rope"] and isinstance(module, Attention) and module.config.rope:
                module.apply_rope = rope
                swapped["rope"] += 1
            if self.switches["glu"] and isinstance(module, GLU):
                module.gated_act = functools.partial(
                    glu, activation=module.act_name, approximate=module.act_approximate
                )
                swapped["glu"] += 1
        if self.cross_entropy is True and hasattr(model, "fused_cross_entropy"):
            model.fused_cross_entropy = True
            swapped["cross_entropy"] = 1
        return swapped
