"""Algorithms change training: registered by YAML name under ``algorithms:``."""

from foundry.algorithms.activation_checkpointing import ActivationCheckpointing
from foundry.algorithms.ema import EMA
from foundry.algorithms.float8 import Float8Training
from foundry.algorithms.fused_kernels import FusedKernels
from foundry.algorithms.gradient_clipping import GradientClipping
from foundry.algorithms.low_precision_layernorm import LowPrecisionLayerNormAlgorithm
from foundry.algorithms.low_precision_residual import LowPrecisionResidual
from foundry.algorithms.nan_guard import NanGuard
from foundry.algorithms.torch_compile import TorchCompile

__all__ = [
    "ActivationCheckpointing",
    "EMA",
    "Float8Training",
    "FusedKernels",
    "GradientClipping",
    "LowPrecisionLayerNormAlgorithm",
    "LowPrecisionResidual",
    "NanGuard",
    "TorchCompile",
]
