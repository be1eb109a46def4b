"""The peak FLOP/s table: dense figures, the right variant per device name, honest 'unknown'."""

from __future__ import annotations

import pytest
import torch

from foundry.callbacks.device_flops import (
    check_peak_override,
    device_peak_flops_per_sec,
    matmul_dtype,
    peak_flops_per_sec,
)
from foundry.errors import ConfigError


@pytest.mark.parametrize(
    ("device_name", "dtype", "expected_tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp8", 1670.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA GH200 480GB", "fp8", 1979),
        ("NVIDIA B200", "bf16", 2250),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA L40S", "bf16", 362.05),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("AMD Instinct MI325X", "fp8", 2614.9),
        ("AMD Instinct MI250X", "bf16", 191.5),
    ],
)
def test_known_devices_give_their_dense_peak(device_name, dtype, expected_tflops):
    assert peak_flops_per_sec(device_name, dtype) == expected_tflops * 1e12


def test_tf32_falls_back_to_fp32_on_devices_without_it():
    assert peak_flops_per_sec("Tesla T4", "tf32") == 8.1e12


@pytest.mark.parametrize(
    "device_name", ["NVIDIA A10G", "NVIDIA GB200", "NVIDIA L40", "NVIDIA RTX A1000", "Some Future GPU"]
)
def test_unknown_devices_have_no_peak(device_name):
    assert peak_flops_per_sec(device_name, "bf16") is None


def test_precision_missing_from_a_row_has_no_peak():
    assert peak_flops_per_sec("NVIDIA A100-SXM4-40GB", "fp8") is None


@pytest.mark.parametrize(
    ("precision", "allow_tf32", "expected"),
    [("amp_bf16", False, "bf16"), ("amp_fp16", True, "fp16"), ("fp32", True, "tf32"), ("fp32", False, "fp32")],
)
def test_trainer_precision_maps_to_matmul_dtype(precision, allow_tf32, expected):
    assert matmul_dtype(precision, allow_tf32) == expected


def test_cpu_has_no_peak():
    assert device_peak_flops_per_sec(torch.device("cpu"), "amp_bf16") is None


def test_a_single_override_is_the_peak_for_any_precision():
    assert device_peak_flops_per_sec(torch.device("cpu"), "amp_bf16", override=5e12) == 5e12


def test_a_per_dtype_override_applies_to_its_dtype_only():
    override = {"bf16": 7e12}
    assert device_peak_flops_per_sec(torch.device("cpu"), "amp_bf16", override=override) == 7e12
    assert device_peak_flops_per_sec(torch.device("cpu"), "amp_fp16", override=override) is None


@pytest.mark.parametrize(("override", "message"), [({"bf17": 1e12}, "Did you mean 'bf16'"), ({"fp8": -1.0}, "fp8")])
def test_bad_overrides_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        check_peak_override(override, "callbacks.speed_monitor.gpu_flops_available")
