"""Algorithms change training: registered by YAML name under ``algorithms:``."""

from foundry.algorithms.gradient_clipping import GradientClipping

__all__ = ["GradientClipping"]
