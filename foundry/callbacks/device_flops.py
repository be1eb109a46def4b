"""Peak dense FLOP/s per accelerator and precision: the denominator of MFU.

Datasheets quote tensor-core peaks "with sparsity" (2:4 structured), which dense training never
reaches; every figure below is the DENSE peak, i.e. the sparse datasheet figure halved where the
sheet only prints the sparse one. Plain FP32 is the non-tensor-core figure on NVIDIA and the
FP32 matrix figure on AMD.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping

import torch

from foundry.errors import ConfigError, did_you_mean

# (regex on the lowercased torch.cuda.get_device_name(), dense TFLOP/s per precision).
# The first match wins, so specific variants (NVL, PCIe) come before the family name.
_PEAK_DENSE_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 NVL datasheet: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* TFLOPS (*sparse).
    (r"h100.*nvl", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    # NVIDIA H100 PCIe datasheet: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026* (*sparse).
    (r"h100.*(pcie|hbm2e)", {"fp32": 51, "tf32": 378, "bf16": 756.5, "fp16": 756.5, "fp8": 1513}),
    # NVIDIA H100 SXM datasheet ("H100 80GB HBM3"): FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*.
    (r"h100", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979}),
    # NVIDIA GH200 Grace Hopper datasheet (its H100 GPU): FP32 67, TF32 494, BF16/FP16 990, FP8 1,979 (dense
    # column; sparse doubles). Before the H200 rows, which would match its name.
    (r"gh200", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979}),
    # NVIDIA H200 NVL datasheet: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* (*sparse).
    (r"h200.*nvl", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    # NVIDIA H200 SXM datasheet: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* (*sparse).
    (r"h200", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979}),
    # NVIDIA HGX B200 datasheet, 8 GPUs: FP32 600 TF, TF32 18*, BF16/FP16 36*, FP8 72* PF (*sparse); / 8.
    (r"\bb200\b", {"fp32": 75, "tf32": 1125, "bf16": 2250, "fp16": 2250, "fp8": 4500}),
    # NVIDIA A100 datasheet (SXM and PCIe, 40 and 80 GB alike): FP32 19.5, TF32 156, BF16/FP16 312
    # (\b: the RTX A1000 is another part).
    (r"\ba100\b", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 (A10G is a different part: no match).
    (r"\ba10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05, FP8 733 (dense column).
    (r"\bl40s\b", {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733}),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485* (*sparse).
    (r"\bl4\b", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5}),
    # NVIDIA V100 datasheet: V100S PCIe FP32 16.4, tensor 130; V100 PCIe 14 / 112; V100 SXM2 15.7 / 125.
    (r"v100s", {"fp32": 16.4, "fp16": 130}),
    (r"v100.*pcie", {"fp32": 14, "fp16": 112}),
    (r"v100", {"fp32": 15.7, "fp16": 125}),
    # NVIDIA T4 datasheet: FP32 8.1, mixed-precision FP16 65.
    (r"\bt4\b", {"fp32": 8.1, "fp16": 65}),
    # AMD MI250X datasheet: FP32 matrix 95.7, BF16/FP16 383 per module; each of its 2 GCDs is one
    # torch device, so halve. ROCm may name both parts "MI250X/MI250": the higher peak is the safe guess.
    (r"mi250x", {"fp32": 47.85, "bf16": 191.5, "fp16": 191.5}),
    # AMD MI250 datasheet: FP32 matrix 90.5, BF16/FP16 362.1 per module; halved per GCD as above.
    (r"mi250", {"fp32": 45.25, "bf16": 181.05, "fp16": 181.05}),
    # AMD MI300X datasheet: FP32 matrix 163.4, TF32 653.7, BF16/FP16 1,307.4, FP8 2,614.9 (dense).
    (r"mi300x", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}),
    # AMD MI325X datasheet: same compute as MI300X (more and faster memory).
    (r"mi325x", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}),
]

MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
_MATMUL_DTYPE = {"amp_bf16": "bf16", "bf16": "bf16", "amp_fp16": "fp16", "fp16": "fp16", "amp_fp8": "fp8", "fp8": "fp8"}


def matmul_dtype(precision: str, allow_tf32: bool) -> str | None:
    """The dtype the matmuls run in for a Trainer ``precision`` ('amp_bf16' → 'bf16'); None if unknown."""
    if precision == "fp32":
        return "tf32" if allow_tf32 else "fp32"
    return _MATMUL_DTYPE.get(precision)


def peak_flops_per_sec(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` in ``dtype``, or None when the table does not know it.

    A device without TF32 (V100, T4, MI250) runs TF32-allowed matmuls in FP32, so 'tf32' falls back.
    """
    name = device_name.lower()
    for pattern, tflops in _PEAK_DENSE_TFLOPS:
        if re.search(pattern, name):
            value = tflops.get(dtype, tflops["fp32"] if dtype == "tf32" else None)
            return None if value is None else value * 1e12
    return None


def check_peak_override(override: float | Mapping[str, float] | None, key_path: str) -> None:
    """Raise ConfigError unless ``override`` is None, a positive FLOP/s, or ``{matmul dtype: positive FLOP/s}``."""
    peaks = override if isinstance(override, Mapping) else {"": override} if override is not None else {}
    for dtype, peak in peaks.items():
        where = f"{key_path}.{dtype}" if dtype else key_path
        if dtype and dtype not in MATMUL_DTYPES:
            raise ConfigError(
                f"'{where}': '{dtype}' is not a matmul dtype{did_you_mean(dtype, MATMUL_DTYPES)}; "
                f"use {', '.join(MATMUL_DTYPES)}."
            )
        if not isinstance(peak, int | float) or peak <= 0:
            raise ConfigError(
                f"'{where}' is {peak!r}; give the device's dense peak FLOP/s as a positive number "
                "(e.g. 989.5e12 for an H100 SXM in bf16), or leave it unset to look it up."
            )


def device_peak_flops_per_sec(
    device: torch.device, precision: str, override: float | Mapping[str, float] | None = None
) -> float | None:
    """Peak FLOP/s of the run's accelerator, or None on CPU or an unknown device (with a warning).

    ``override`` (the user's ``gpu_flops_available``) wins: one number for any precision, or a map from
    matmul dtype to peak; a dtype the map lacks is looked up as usual.
    """
    if isinstance(override, int | float):
        return float(override)
    dtype = matmul_dtype(precision, torch.backends.cuda.matmul.allow_tf32)
    if override and dtype in override:
        return float(override[dtype])
    if device.type != "cuda":
        return None
    device_name = torch.cuda.get_device_name(device)
    peak = peak_flops_per_sec(device_name, dtype) if dtype else None
    if peak is None:
        warnings.warn(
            f"No peak FLOP/s is known for '{device_name}' at precision '{precision}', so MFU is not logged. "
            "Set callbacks.speed_monitor.gpu_flops_available to the device's dense peak FLOP/s "
            "(e.g. 989.5e12, or per dtype: {bf16: 989.5e12, fp8: 1979e12}) to log it.",
            stacklevel=2,
        )
    return peak
