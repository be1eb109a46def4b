"""benchmarks/qlora_vs_lora.py's gaps and run overrides, on synthetic curves (no training)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import qlora_vs_lora


def test_centred_mean_averages_each_batch_with_its_neighbours():
    curve = {1: 0.0, 2: 3.0, 3: 6.0, 4: 9.0}
    assert qlora_vs_lora.centred_mean(curve, 3) == {1: 1.5, 2: 3.0, 3: 6.0, 4: 7.5}


def test_gaps_smooth_away_alternating_noise_but_keep_a_steady_offset():
    reference = {step: 10.0 - 0.01 * step for step in range(1, 201)}
    noisy = {step: loss + 0.05 * (-1) ** step for step, loss in reference.items()}
    offset = {step: loss + 0.03 for step, loss in reference.items()}
    noise, steady = (qlora_vs_lora.gaps(curve, reference, window=10) for curve in (noisy, offset))
    assert noise["max_abs_gap"] == pytest.approx(0.05)
    # a full window of 10 cancels the noise; the first batch's holds 5 (its odd one out leaves 0.05 / 5)
    assert noise["max_abs_gap_smoothed_10"] == pytest.approx(0.01)
    assert steady["max_abs_gap_smoothed_10"] == pytest.approx(0.03)
    assert steady["mean_last_50"] - steady["reference_mean_last_50"] == pytest.approx(0.03)
    assert steady["common_batches"] == 200


def test_both_runs_share_every_override_but_the_base_storage():
    args = argparse.Namespace(data="data/q", batches=200, global_batch=8, smoke=False)
    lora, qlora = (qlora_vs_lora.run_overrides(name, args) for name in ("lora", "qlora"))
    assert [o for o in lora if not o.startswith(("model.peft_config", "run_name"))] == [
        o for o in qlora if not o.startswith(("model.peft_config", "run_name"))
    ]
    assert any("quantize_base: true" in o for o in qlora) and any("base_dtype: bfloat16" in o for o in lora)
