"""Algorithms change training: registered by YAML name under ``algorithms:``."""

from foundry.algorithms.fused_kernels import FusedKernels
from foundry.algorithms.gradient_clipping import GradientClipping

__all__ = ["FusedKernels", "GradientClipping"]
