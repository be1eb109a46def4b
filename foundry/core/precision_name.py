"""The names of a run's numeric precisions, without torch: configs parse before torch is imported.

What each one does (autocast, loss scaling) is ``foundry.core.precision``.
"""

from __future__ import annotations

import enum


class Precision(str, enum.Enum):
    """A run's numeric precision; a plain string of its value (``"amp_bf16"``) is equal to it."""

    AUTO = "auto"  # the default: amp_bf16 on a GPU, fp32 elsewhere (``foundry.core.precision.check_precision``)
    FP32 = "fp32"
    AMP_BF16 = "amp_bf16"  # bf16 autocast, fp32 weights and optimizer state
    AMP_FP16 = "amp_fp16"  # fp16 autocast with loss scaling (CUDA only)

    def __str__(self) -> str:
        return self.value


PRECISIONS = tuple(precision.value for precision in Precision)
