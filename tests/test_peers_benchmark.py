"""benchmarks/peers.py's arithmetic and plumbing, without running any framework."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peers
import peers_rows
from bench_utils import model_from_yaml


@pytest.mark.parametrize(("yaml", "shape"), [("llama-1b", peers_rows.LLAMA_1B), ("mpt-1b", peers_rows.MPT_1B)])
def test_shape_counts_the_active_parameters_foundrys_model_has(yaml: str, shape: peers_rows.Shape) -> None:
    model, _ = model_from_yaml(peers_rows.REPO_ROOT / "yamls" / "pretrain" / f"{yaml}.yaml")
    assert shape.active_params() == model.n_active_params


def test_untied_output_is_counted_in_place_of_the_input_embedding() -> None:
    tied = peers_rows.Shape("llama", 64, 2, 1000, n_heads=4, kv_heads=2, ffn_hidden=128, tied=True)
    untied = peers_rows.Shape("llama", 64, 2, 1000, n_heads=4, kv_heads=2, ffn_hidden=128, tied=False)
    assert untied.active_params() == tied.active_params()


def test_torchtitan_toml_reads_back_as_the_config(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path / "data", tmp_path / "work", global_batch=16, steps=30)
    row = peers_rows.ROWS["torchtitan-llama-8b"]
    config = peers_rows.titan_config(row, settings)
    parsed = tomllib.loads(peers_rows.to_toml(config))
    assert parsed == config
    assert parsed["training"]["global_batch_size"] == 16 and parsed["training"]["local_batch_size"] == 4
    assert parsed["activation_checkpoint"]["mode"] == "full"


def test_torchtitan_rows_launch_with_its_run_scripts_allocator_setting(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path / "data", tmp_path / "work", global_batch=16, steps=30)
    _, environment = peers_rows.command(peers_rows.ROWS["torchtitan-llama-8b"], settings)
    assert environment == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def test_throughput_is_timed_from_the_last_warmup_step_to_the_last_step(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=7, peak_tflops=1000.0)
    row = peers_rows.ROWS["foundry-mpt-1b"]
    step_times_s = {1: 40.0, 2: 41.0, 3: 42.0, 4: 42.5, 5: 43.0, 6: 43.5, 7: 44.0}
    watched = {"returncode": 0, "killed": False, "wall_s": 50.0, "step_times_s": step_times_s, "peak_gib": None,
               "log": []}  # fmt: skip
    result = peers.measure(row, settings, warmup=3, watched=watched)
    tokens_per_s = 16 * 2048 * 4 / 2.0
    assert result["tokens_per_s_per_gpu"] == pytest.approx(tokens_per_s)
    assert result["mfu"] == pytest.approx(tokens_per_s * row.shape.flops_per_token() / 1e15)
    assert result["first_batch_s"] == 40.0


def test_a_failed_row_keeps_its_last_error_line(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=7)
    log = ["starting", "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB", "exiting"]
    watched = {"returncode": 1, "killed": False, "wall_s": 5.0, "step_times_s": {}, "peak_gib": None, "log": log}
    result = peers.measure(peers_rows.ROWS["foundry-mpt-1b"], settings, warmup=3, watched=watched)
    assert result["error"] == "exit 1: RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"


def test_peer_ratio_is_foundry_over_the_peer() -> None:
    results = [{"row": "foundry-llama-1b", "tokens_per_s_per_gpu": 60.0},
               {"row": "torchtitan-llama-1b", "tokens_per_s_per_gpu": 50.0}]  # fmt: skip
    peers.ratios(results)
    assert results[1]["foundry_vs_peer"] == 1.2 and "foundry_vs_peer" not in results[0]
