"""Algorithms change training: registered by YAML name under ``algorithms:``."""

from foundry.algorithms.fused_kernels import FusedKernels
from foundry.algorithms.gradient_clipping import GradientClipping
from foundry.algorithms.torch_compile import TorchCompile

__all__ = ["FusedKernels", "GradientClipping", "TorchCompile"]
