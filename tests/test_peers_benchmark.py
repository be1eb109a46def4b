"""benchmarks/peers.py's arithmetic and plumbing, without running any framework."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peers
import peers_data
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


@pytest.mark.parametrize(("name", "dtype"), [("torchtitan-llama-8b-64k", "float32"),
                                             ("torchtitan-llama-8b-64k-bf16", "bfloat16")])  # fmt: skip
def test_long_context_torchtitan_toml_splits_each_sequence_over_two_gpus(tmp_path: Path, name: str, dtype: str) -> None:
    settings = peers_rows.Settings(tmp_path / "data", tmp_path / "work", global_batch=2, steps=3)
    config = peers_rows.titan_config(peers_rows.ROWS[name], settings)
    parsed = tomllib.loads(peers_rows.to_toml(config))
    assert parsed == config
    assert parsed["training"] | {"dataset_path": None} == {
        "local_batch_size": 1, "global_batch_size": 2, "seq_len": 65536, "max_norm": 1.0, "steps": 3,
        "dataset": "c4_test", "dataset_path": None, "dtype": dtype}  # fmt: skip
    assert parsed["parallelism"] == {
        "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1, "context_parallel_degree": 2,
        "context_parallel_load_balancer": "headtail", "context_parallel_rotate_method": "allgather"}  # fmt: skip
    assert parsed["activation_checkpoint"]["mode"] == "full" and parsed["compile"]["enable"]
    assert parsed["model"]["flavor"] == "8B"


def test_long_context_foundry_row_trains_the_64k_yaml_on_65536_token_samples(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path / "data", tmp_path / "work", global_batch=2, steps=3)
    row = peers_rows.ROWS["foundry-llama-8b-64k"]
    argv, _ = peers_rows.command(row, settings)
    assert argv[argv.index("train") + 1] == str(peers_rows.REPO_ROOT / "yamls/pretrain/llama-8b-64k.yaml")
    assert argv[-2:] == ["--nproc", "2"]
    assert "global_train_batch_size=2" in argv and "max_duration=3ba" in argv
    assert f"variables.data_local={tmp_path / 'work' / 'mds-65536'}" in argv  # built by `run` when not prepared
    (tmp_path / "data" / "mds-65536" / "train").mkdir(parents=True)
    (tmp_path / "data" / "mds-65536" / "train" / "index.json").write_text("{}")
    argv, _ = peers_rows.command(row, settings)
    assert f"variables.data_local={tmp_path / 'data' / 'mds-65536'}" in argv
    two_k, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b"], settings)
    assert f"variables.data_local={tmp_path / 'data' / 'mds'}" in two_k


def test_long_samples_are_the_short_samples_joined_in_order(tmp_path: Path) -> None:
    from streaming import LocalDataset

    stream = np.arange(5 * 64, dtype=np.uint16)  # five 64-token samples of one stream
    stream.tofile(tmp_path / "tokens.bin")
    assert peers_data.write_long_samples(tmp_path / "tokens.bin", 128, tmp_path / "mds-128") == 2
    dataset = LocalDataset(local=str(tmp_path / "mds-128" / "train"))
    samples = np.stack([dataset[index]["tokens"] for index in range(len(dataset))])
    assert samples.dtype == np.int32 and samples.tolist() == stream[:256].reshape(2, 128).tolist()


def test_long_context_throughput_and_mfu_count_the_rows_sequence_length(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=2, steps=3, peak_tflops=1000.0)
    row = peers_rows.ROWS["foundry-llama-8b-64k"]
    watched = {"returncode": 0, "killed": False, "wall_s": 200.0, "step_times_s": {1: 130.0, 2: 150.0, 3: 170.0},
               "peak_gib": None, "log": []}  # fmt: skip
    result = peers.measure(row, settings, warmup=1, watched=watched)
    tokens_per_s = 2 * 65536 * 2 / 40.0 / 2  # per GPU
    attention_over_the_full_square = 4 * 32 * 4096 * 65536
    flops_per_token = 3 * (2 * peers_rows.LLAMA_8B.active_params() + attention_over_the_full_square)
    assert result["tokens_per_s_per_gpu"] == pytest.approx(tokens_per_s)
    assert result["flops_per_token"] == flops_per_token
    assert result["mfu"] == pytest.approx(tokens_per_s * flops_per_token / 1e15)


def test_long_context_flag_runs_the_long_rows_with_short_defaults() -> None:
    args = argparse.Namespace(long_context=True, global_batch=None, warmup=None, steps=4)
    peers.resolve_defaults(args)
    assert (args.global_batch, args.warmup, args.steps) == (2, 1, 4)
    assert peers_rows.LONG_CONTEXT_ROWS == ["foundry-llama-8b-64k", "torchtitan-llama-8b-64k-bf16",
                                            "foundry-llama-8b-64k-end-aligned", "torchtitan-llama-8b-64k"]  # fmt: skip
    assert not set(peers_rows.LONG_CONTEXT_ROWS) & set(peers_rows.TWO_GPU_ROWS)
    peer_rows = [name for name in peers_rows.LONG_CONTEXT_ROWS if peers_rows.ROWS[name].framework != "foundry"]
    assert all(peers_rows.ROWS[name].compare_to == "foundry-llama-8b-64k" for name in peer_rows)


def test_a_foundry_row_passes_its_overrides_after_the_shared_ones(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=2, steps=3, peak_tflops=1000.0)
    argv, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b-64k-end-aligned"], settings)
    assert argv[-3:] == ["parallelism.context_parallel_attention=end_aligned", "--nproc", "2"]


def test_the_float8_pair_turns_on_each_frameworks_own_float8_recipe(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=3, peak_tflops=1000.0)
    titan = peers_rows.titan_config(peers_rows.ROWS["torchtitan-llama-8b-float8"], settings)
    assert titan["model"]["converters"] == ["quantize.linear.float8"]
    assert titan["quantize.linear.float8"] == {"enable_fsdp_float8_all_gather": True,
                                               "precompute_float8_dynamic_scale_for_fsdp": True,
                                               "filter_fqns": ["output"]}  # fmt: skip
    plain = peers_rows.titan_config(peers_rows.ROWS["torchtitan-llama-8b"], settings)
    assert plain["model"]["converters"] == [] and "quantize.linear.float8" not in plain
    argv, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b-float8"], settings)
    assert "algorithms.float8={}" in argv
    assert peers_rows.ROWS["torchtitan-llama-8b-float8"].compare_to == "foundry-llama-8b-float8"


def test_the_unfused_loss_row_differs_from_the_shipped_8b_row_by_its_loss_only(tmp_path: Path) -> None:
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=3, peak_tflops=1000.0)
    shipped, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b"], settings)
    unfused, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b-unfused-loss"], settings)

    def settings_of(argv: list[str]) -> list[str]:  # each row writes its own run folder
        return [arg for arg in argv if not arg.startswith("run_folder=")]

    assert "model.loss_fn=torch_crossentropy" in unfused
    assert [arg for arg in settings_of(unfused) if arg != "model.loss_fn=torch_crossentropy"] == settings_of(shipped)


def test_the_8b_rows_checkpoint_every_block_as_their_peers_do_but_the_auto_row(tmp_path: Path) -> None:
    """llama-8b.yaml ships activation_checkpointing: auto: a row set against torchtitan's ``full`` mode, or measured
    beside one, pins every block; the row set against torchtitan without checkpointing keeps auto."""
    from foundry.yaml_config import apply_overrides, load_yaml

    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=3, peak_tflops=1000.0)
    peer_mode = {row.compare_to: row.titan_ac for row in peers_rows.ROWS.values() if row.framework == "torchtitan"}
    shipped = load_yaml(peers_rows.REPO_ROOT / "yamls/pretrain/llama-8b.yaml")
    assert shipped["fsdp_config"]["activation_checkpointing"] == "auto"
    checkpointing = {}
    for name, row in peers_rows.ROWS.items():
        if row.yaml == "yamls/pretrain/llama-8b.yaml":
            overrides = [arg for arg in peers_rows.command(row, settings)[0] if "=" in arg]
            checkpointing[name] = apply_overrides(shipped, overrides)["fsdp_config"]["activation_checkpointing"]
            beside = "none" if "-ac-" in name else "full"  # the 8k levers run beside the pair without it
            assert (peer_mode.get(name, beside) == "full") == (checkpointing[name] is True)
    auto_rows = [name for name, value in checkpointing.items() if value == "auto"]
    assert auto_rows == [
        "foundry-llama-8b-8k-4gpu-float8-ac-auto", "foundry-llama-8b-8k-4gpu-float8-all-blocks-ac-auto",
        "foundry-llama-8b-8k-4gpu-float8-rowwise-with-gw-hp-ac-auto",
        "foundry-llama-8b-8k-4gpu-float8-blockwise-ac-auto",
    ] and len(checkpointing) == 10  # fmt: skip
    assert checkpointing["foundry-llama-8b-8k-4gpu-float8-ac-none-mb2"] is False


def test_profile_runs_one_step_more_profiled_by_each_frameworks_own_profiler(tmp_path: Path) -> None:
    from foundry.yaml_config import apply_overrides, load_yaml

    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=11, profile=True)
    argv, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b"], settings)
    overrides = [arg for arg in argv if "=" in arg]
    cfg = apply_overrides(load_yaml(peers_rows.REPO_ROOT / "yamls/pretrain/llama-8b.yaml"), overrides)
    assert cfg["max_duration"] == "12ba"
    assert cfg["callbacks"]["profiler"] == {"skip_batches": 11}  # the 12th batch, left out of the timing
    titan = peers_rows.titan_config(peers_rows.ROWS["torchtitan-llama-8b"], settings)
    assert titan["training"]["steps"] == 12 and titan["profiling"]["profile_freq"] == 12
    assert "profiling" not in peers_rows.titan_config(peers_rows.ROWS["torchtitan-llama-8b"],
                                                      peers_rows.Settings(tmp_path, tmp_path, 16, 11))  # fmt: skip
    watched = {"returncode": 0, "killed": False, "wall_s": 30.0, "peak_gib": None, "log": [],
               "step_times_s": {step: 10.0 + step for step in range(1, 12)} | {12: 40.0}}  # fmt: skip
    measured = peers.measure(peers_rows.ROWS["foundry-llama-8b"], settings, warmup=3, watched=watched)
    assert (measured["timed_steps"], measured["step_s"]) == (8, 1.0)  # steps 3 to 11; the slow 12th is not timed


def test_a_chrome_trace_summary_splits_the_step_into_compute_exposed_communication_and_idle(tmp_path: Path) -> None:
    from profile_summary import summarize_chrome_trace

    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        kernel("sm90_xmma_gemm_bf16", 0, 400),
        kernel("ncclDevKernel_AllGather", 300, 300),  # 100 us hidden
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 700, "dur": 100},
        kernel("multi_tensor_apply_kernel adam", 900, 100),  # idle 600-700 and 800-900
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host events are not the device's
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize_chrome_trace(path)
    assert summary["wall_ms"] == pytest.approx(1.0)
    assert summary["ms"]["gemm"] == pytest.approx(0.4) and summary["ms"]["comm"] == pytest.approx(0.3)
    assert summary["ms"]["data"] == pytest.approx(0.1) and summary["ms"]["optimizer"] == pytest.approx(0.1)
    assert summary["timeline"] == pytest.approx({"compute_ms": 0.6, "exposed_comm_ms": 0.2, "idle_ms": 0.2})
    assert summary["top_kernels"][0][:2] == ("sm90_xmma_gemm_bf16", "gemm")


def test_a_row_stopped_at_its_timeout_takes_the_workers_it_started_with_it(tmp_path: Path) -> None:
    """A launcher's workers would hold their GPUs into the next row (or the next call) if only it were killed."""
    pid_file = tmp_path / "worker.pid"
    launcher = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
        "print('step 1', flush=True)\n"
        "time.sleep(120)\n"
    )
    watched = peers.watch([sys.executable, "-c", launcher], dict(os.environ), re.compile(r"step (\d+)"), timeout_s=3)
    assert watched["killed"] and 1 in watched["step_times_s"]
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and process_alive(worker):
        time.sleep(0.1)
    assert not process_alive(worker)


def process_alive(pid: int) -> bool:
    """Running, not gone or a zombie waiting for a parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state


def test_four_gpu_flag_runs_the_8k_float8_rows_of_both_frameworks_on_four_gpus(tmp_path: Path) -> None:
    args = argparse.Namespace(long_context=False, four_gpu=True, global_batch=None, warmup=None, steps=None)
    peers.resolve_defaults(args)
    assert (args.global_batch, args.warmup, args.steps) == (16, 2, 5)
    assert peers_rows.FOUR_GPU_ROWS == ["foundry-llama-8b-8k-4gpu-float8", "torchtitan-llama-8b-8k-4gpu-float8",
                                        "foundry-llama-8b-8k-4gpu-float8-rowwise",
                                        "foundry-llama-8b-8k-4gpu-float8-ac-auto",
                                        "torchtitan-llama-8b-8k-4gpu-float8-ac-none",
                                        "foundry-llama-8b-8k-4gpu-float8-all-blocks-ac-auto",
                                        "foundry-llama-8b-8k-4gpu-float8-ac-none-mb2",
                                        "foundry-llama-8b-8k-4gpu-float8-rowwise-with-gw-hp-ac-auto",
                                        "foundry-llama-8b-8k-4gpu-float8-blockwise-ac-auto"]  # fmt: skip
    assert not set(peers_rows.FOUR_GPU_ROWS) & set(peers_rows.LONG_CONTEXT_ROWS + peers_rows.TWO_GPU_ROWS)
    settings = peers_rows.Settings(tmp_path, tmp_path, global_batch=16, steps=7, peak_tflops=1000.0)
    titan_row = peers_rows.ROWS["torchtitan-llama-8b-8k-4gpu-float8"]
    titan = peers_rows.titan_config(titan_row, settings)
    assert (titan["training"]["seq_len"], titan["training"]["local_batch_size"]) == (8192, 1)
    assert titan["model"]["converters"] == ["quantize.linear.float8"]
    assert "--nproc_per_node=4" in peers_rows.command(titan_row, settings)[0]
    unchecked = peers_rows.titan_config(peers_rows.ROWS["torchtitan-llama-8b-8k-4gpu-float8-ac-none"], settings)
    assert unchecked["activation_checkpoint"]["mode"] == "none" and titan["activation_checkpoint"]["mode"] == "full"
    auto_argv, _ = peers_rows.command(peers_rows.ROWS["foundry-llama-8b-8k-4gpu-float8-ac-auto"], settings)
    assert {"fsdp_config.activation_checkpointing=auto", "algorithms.float8={}"} <= set(auto_argv)
    from foundry.yaml_config import apply_overrides, load_yaml

    shipped = load_yaml(peers_rows.REPO_ROOT / "yamls/pretrain/llama-8b.yaml")
    levers = {}
    for lever in ("ac-auto", "all-blocks-ac-auto", "ac-none-mb2", "rowwise-with-gw-hp-ac-auto", "blockwise-ac-auto"):
        argv, _ = peers_rows.command(peers_rows.ROWS[f"foundry-llama-8b-8k-4gpu-float8-{lever}"], settings)
        levers[lever] = apply_overrides(shipped, [arg for arg in argv if "=" in arg])
        assert argv[-2:] == ["--nproc", "4"]
    assert [levers[lever]["fsdp_config"]["activation_checkpointing"] for lever in levers] == [
        "auto", "auto", False, "auto", "auto"
    ]  # fmt: skip
    assert levers["ac-auto"]["algorithms"]["float8"] == {}
    assert levers["all-blocks-ac-auto"]["algorithms"]["float8"] == {"keep_first_and_last_blocks": False}
    assert levers["blockwise-ac-auto"]["algorithms"]["float8"] == {"recipe": "blockwise"}
    assert levers["rowwise-with-gw-hp-ac-auto"]["algorithms"]["float8"] == {"recipe": "rowwise_with_gw_hp"}
    assert [levers[lever]["device_train_microbatch_size"] for lever in levers] == [1, 1, 2, 1, 1]
    argv, _ = peers_rows.command(peers_rows.ROWS[titan_row.compare_to], settings)
    assert argv[-2:] == ["--nproc", "4"]
    assert {"variables.max_seq_len=8192", "device_train_microbatch_size=1", "algorithms.float8={}"} <= set(argv)
    assert f"variables.data_local={tmp_path / 'mds-8192'}" in argv  # built from tokens.bin at run time
