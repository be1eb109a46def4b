"""benchmarks/moe.py's ``profile`` and ``sweep`` parts: where an OLMoE-shaped step's time goes, and how it scales.

- ``layer_profile`` (1 GPU): one MoE layer of OLMoE's shape with bf16 weights and input (what FSDP2's PURE
  mixed precision hands it), forward + backward, on each token count eager, and compiled on the first:
  the median time, the expert GEMMs' achieved TFLOP/s, the activations the forward keeps for backward
  (MiB, parameters and input excluded), whether the step ran without a host sync (CUDA's sync debug
  mode, with the line that synced if not), and a profile of one step: kernel time by category, the top
  kernels, host-sync events.
- ``sweep`` (one torchrun per layout): one Trainer, built as ``foundry train`` builds it from
  ``moe-1b-7b.yaml``, trains segments of batches one after another, each segment a (sequences per GPU
  per batch, sequences per microbatch) pair, and writes each segment's row (tokens/s per GPU, MFU on
  active parameters, peak memory) as soon as it ends, so a later segment that runs out of memory keeps
  the rows before it. The first segment's last batch is profiled (``foundry.callbacks.Profiler``: a
  summary per rank).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from bench_utils import cuda_time_ms, random_batch, yaml_trainer
from torch import nn
from torch.profiler import ProfilerActivity, profile

from foundry import Callback
from foundry.callbacks import Profiler
from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.callbacks.profiler import summarize
from foundry.config import load_train_config
from foundry.distributed import get_rank
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig

OLMOE_LAYER = MoEConfig(num_experts=64, top_k=8, hidden_size=1024, glu=True, act=ActFnConfig("silu"))
# (sequences per GPU per batch, sequences per microbatch), in the order they run: memory grows along the list.
# (8, 2) trains as the YAML does, several microbatches a batch: one optimizer step and clipping per 8 sequences.
SWEEP_SEGMENTS = ((1, 1), (2, 2), (8, 2), (4, 4), (8, 8))
TOP_KERNELS = 30


def layer_profile(
    device: torch.device, token_counts: Sequence[int], d_model: int, config: MoEConfig
) -> list[dict[str, Any]]:
    """The layer's forward + backward at each token count (one microbatch's tokens), eager, and compiled at the
    first (on a GPU): time, the expert GEMMs' rate, the first host sync, one step's kernel profile."""
    torch.manual_seed(0)
    moe = MoE(d_model, config).to(device)
    for parameter in moe.parameters():
        nn.init.normal_(parameter, std=0.02)
    moe.to(torch.bfloat16)
    compiled = torch.compile(moe)
    projections = 3 if config.glu else 2
    rows = []
    for tokens in token_counts:
        x = torch.randn(1, tokens, d_model, device=device, dtype=torch.bfloat16, requires_grad=True)
        expert_flops = 3 * 2 * tokens * config.top_k * projections * d_model * config.hidden_size  # fwd + 2x bwd
        variants = {"eager": moe, "compiled": compiled} if device.type == "cuda" and not rows else {"eager": moe}
        for variant, module in variants.items():

            def step(module: nn.Module = module, x: torch.Tensor = x) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = module(x)
                out.float().square().mean().backward()

            try:
                measured = _timed_and_profiled(step, device, expert_flops)
                measured["saved_for_backward_MiB"] = saved_for_backward_mib(module, x, device)
            except Exception as error:  # one failed variant (a compile error) must not lose the others
                measured = {"error": f"{type(error).__name__}: {str(error)[:300]}", "profile": {"ms": {}}}
            rows.append({"variant": variant, "tokens": tokens, **measured})
    return rows


def _timed_and_profiled(step: Callable[[], Any], device: torch.device, expert_flops: int) -> dict[str, Any]:
    times = sorted(step_times_ms(step, device, warmup=3, iters=20))
    median_ms = times[len(times) // 2]
    return {
        "median_ms_fwd_bwd": round(median_ms, 3),
        "expert_gemm_tflops_per_s": round(expert_flops / median_ms / 1e9, 1),
        "host_sync": first_host_sync(step, device),
        "profile": profiled(step, device),
    }


def saved_for_backward_mib(module: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """MiB of the distinct storages one training forward keeps for backward, parameters and ``x`` excluded."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in (x, *module.parameters())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    keep = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with keep, torch.autocast(device.type, dtype=torch.bfloat16):
        out = module(x)
    del out
    return round(sum(saved.values()) / 2**20, 1)


def step_times_ms(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    if device.type == "cuda":
        return cuda_time_ms(step, warmup, iters)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def first_host_sync(step: Callable[[], Any], device: torch.device) -> str | None:
    """``"none"`` if ``step`` never waits for the device, else where it first did (CUDA's sync debug mode)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        frames = [f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}" for frame in
                  traceback.extract_tb(error.__traceback__)[-4:]]  # fmt: skip
        return f"{str(error).splitlines()[0][:160]} at {' < '.join(reversed(frames))}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def profiled(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One call of ``step`` under torch.profiler, summarised as the profiler callback does (top kernels trimmed)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    summary = summarize(prof, wall_ms)
    summary["top_kernels"] = summary["top_kernels"][:TOP_KERNELS]
    return summary


class SweepRecorder(Callback):
    """Sets each batch's microbatch size from its segment, times each segment's last ``timed`` batches, and
    writes the rows so far (rank 0) whenever a segment ends."""

    def __init__(
        self,
        segments: Sequence[tuple[int, int]],
        warmup: int,
        timed: int,
        layout: str,
        row_file: Path | None,
        profiled_batches: int = 1,  # the first segment's extra batches, after its timed ones
    ) -> None:
        self.segments, self.warmup, self.timed, self.layout, self.row_file = segments, warmup, timed, layout, row_file
        self.plan = [
            (index, position)
            for index in range(len(segments))
            for position in range(warmup + timed + (profiled_batches if index == 0 else 0))
        ]
        self.rows: list[dict[str, Any]] = []
        self._batch, self._timed_from_s = 0, 0.0

    def batch_start(self, state: Any, logger: Any) -> None:
        index, position = self.plan[self._batch]
        state.device_train_microbatch_size = self.segments[index][1]
        if position == 0 and state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(state.device)

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        now = time.perf_counter()
        index, position = self.plan[self._batch]
        self._batch += 1
        if position == self.warmup - 1:
            self._timed_from_s = now
        if position == self.warmup + self.timed - 1:
            self.rows.append(self._row(state, index, (now - self._timed_from_s) / self.timed))
            if self.row_file is not None and get_rank() == 0:
                self.row_file.write_text(json.dumps({"rows": self.rows}))

    def _row(self, state: Any, index: int, seconds: float) -> dict[str, Any]:
        sequences, microbatch = self.segments[index]
        seq_len = state.batch["input_ids"].shape[1]
        cuda = state.device.type == "cuda"
        peak = peak_flops_per_sec(torch.cuda.get_device_name(state.device), "bf16") if cuda else None
        flops = state.model.flops_per_batch(state.batch)
        return {
            "layout": self.layout,
            "sequences_per_gpu_per_batch": sequences,
            "microbatch": microbatch,
            "tokens_per_gpu_per_batch": sequences * seq_len,
            "s_per_batch": round(seconds, 4),
            "tokens_per_s_per_gpu": round(sequences * seq_len / seconds, 1),
            "mfu_active": round(flops / seconds / peak, 4) if peak else None,
            "peak_mem_GiB": round(torch.cuda.max_memory_allocated(state.device) / 2**30, 2) if cuda else None,
        }


def sweep(
    yaml: Path,
    overrides: Sequence[str],
    layout: str,
    device: torch.device,
    row_file: Path | None,
    profile_folder: Path,
    segments: Sequence[tuple[int, int]] = SWEEP_SEGMENTS,
    warmup: int = 3,
    timed: int = 3,
    profiled: int = 1,
) -> list[dict[str, Any]]:
    """Train the YAML's model through the segments in one Trainer; the rows (see ``SweepRecorder``).

    ``profiled`` (0 or 1): whether the first segment ends with a profiled batch.
    """
    cfg, _ = load_train_config(yaml, list(overrides))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    recorder = SweepRecorder(segments, warmup, timed, layout, row_file, profiled)
    cpu = torch.device("cpu")
    batches = [random_batch(segments[index][0], cfg.max_seq_len, cfg.model["vocab_size"], cpu) for index, _ in
               recorder.plan]  # fmt: skip
    # The summary only: exporting a whole step's trace on each rank takes longer than the step's segment.
    profiler = Profiler(skip_batches=warmup + timed, batches=1, trace=False, folder=str(profile_folder))
    callbacks = [recorder, profiler] if profiled else [recorder]
    trainer = yaml_trainer(cfg, batches, segments[0][1], callbacks, device=device)
    trainer.fit()
    return recorder.rows
