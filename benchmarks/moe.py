"""Mixture of experts on GPUs, in one call: grouped GEMMs, a small MoE beside its dense twin, OLMoE-1B-7B on two GPUs.

    python benchmarks/moe.py --out OUT_DIR            # all three parts (two GPUs for the last), under 9 minutes
    python benchmarks/moe.py --parts layer --out OUT_DIR
    python benchmarks/moe.py --parts profile sweep --out OUT_DIR   # where the time goes; the microbatch sweep
    python benchmarks/moe.py --parts profile sweep --smoke      # the same code path, tiny, on two CPU ranks
    python benchmarks/moe.py --parts sweep --checkpointing --out OUT_DIR  # the sweep with activation checkpointing

Parts (each writes ``<out>/moe_<part>.json``: rows plus device, torch and date):

- ``layer`` (1 GPU): one MoE layer of OLMoE-1B-7B's shape (d_model 2048, 64 SwiGLU experts of 1024,
  top-8) on 4,096 tokens, forward + backward under bf16 autocast: the grouped GEMM
  (``torch._grouped_mm``) against the per-expert loop over contiguous slices (how transformers runs
  experts), their outputs compared.
- ``small`` (1 GPU): a small MoE Llama (16 experts of 1408, top-2) beside the dense Llama whose SwiGLU is
  as wide as the two active experts (2816), same attention, through the Trainer (compiled blocks):
  tokens/s and MFU on active parameters.
- ``olmoe`` (2 GPUs, torchrun): ``yamls/pretrain/moe-1b-7b.yaml`` at 4,096 tokens per GPU, FSDP2
  alone and FSDP2 + expert parallelism over both GPUs (``parallelism.expert_parallel_degree: 2``):
  tokens/s per GPU, MFU on active parameters, peak memory. A row that fails (out of memory) is
  retried with activation checkpointing and says so.
- ``profile`` (1 GPU; ``benchmarks/moe_profile.py``): the OLMoE layer with bf16 weights, forward + backward,
  on 4,096 tokens eager and compiled and on 16,384 eager: time, the expert GEMMs' TFLOP/s, the first host
  sync if any (CUDA's sync debug mode), one step's profile (kernel time by category, top-30 kernels,
  host-sync events).
- ``sweep`` (2 GPUs, one torchrun per layout, FSDP2 then FSDP2 + EP2): ``moe-1b-7b.yaml`` through one Trainer
  over segments of (sequences per GPU per batch, sequences per microbatch) = (1, 1), (2, 2), (8, 2), (4, 4),
  (8, 8): tokens/s per GPU, MFU on active parameters, peak memory per segment; a segment that runs out of
  memory ends that layout's run and keeps the rows before it. The first segment's last batch is
  profiled on each rank (``<out>/moe_profile_<layout>/rank<r>.summary.json``).
- ``parity`` (2 GPUs, its own call: ``--parts parity``): a small MoE (8 experts, top-2, d_model 512) trained
  200 steps in bf16 on real text (Python's help topics, a 4,096-token BPE) with FSDP2 alone twice and with
  FSDP2 + EP2 once, same seed and data: the largest per-step loss gap EP2 vs EP1 beside the EP1 vs EP1
  run-to-run gap (atomics in the backward make bf16 runs differ), and the final losses.

Batches are random tokens fed from memory (the GPU image has no mosaicml-streaming); time is wall
time between the ends of the first and last timed batches, after a device sync.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from bench_utils import (
    REPO_ROOT,
    cuda_time_ms,
    environment,
    markdown_table,
    random_batch,
    save_json,
    write_results,
    yaml_trainer,
)
from moe_profile import OLMOE_LAYER, layer_profile, sweep

from foundry import Callback
from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.config import load_train_config
from foundry.core import LoggerDestination
from foundry.distributed import get_rank, get_world_size
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig

OLMOE_YAML = REPO_ROOT / "yamls/pretrain/moe-1b-7b.yaml"
# The small pair: same attention and depth; the MoE's two active experts are as wide as the dense SwiGLU.
# not checkpointed: the rows compare the two FFNs' speed (moe-1b-7b.yaml checkpoints every block for memory)
SMALL_MODEL = [
    "model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.max_seq_len=2048",
    "fsdp_config.activation_checkpointing=false",
]  # fmt: skip
SMALL_MOE = [*SMALL_MODEL, "model.moe_num_experts=16", "model.moe_top_k=2", "model.ffn_hidden_size=1408"]
SMALL_DENSE = [*SMALL_MODEL, "model.moe_num_experts=null", "model.ffn_hidden_size=2816"]
PARITY_MODEL = [
    "model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.vocab_size=4096", "model.max_seq_len=512",
    "model.moe_num_experts=8", "model.moe_top_k=2", "model.ffn_hidden_size=512",
]  # fmt: skip
PARITY_SEQ_LEN, PARITY_MICROBATCH = 512, 8
LAYOUTS = (("FSDP2", []), ("FSDP2 + EP2", ["parallelism.expert_parallel_degree=2"]))
CHECKPOINTING = "fsdp_config.activation_checkpointing=true"
# --smoke: the profile and sweep parts' code path on two CPU ranks, with a model a CPU trains in seconds
SMOKE_MODEL = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=256", "model.ffn_hidden_size=32",
    "model.moe_num_experts=4", "model.moe_top_k=2", "model.attn_impl=sdpa", "model.init_device=cpu",
    "variables.max_seq_len=32",
]  # fmt: skip
SMOKE_LAYER = MoEConfig(num_experts=4, top_k=2, hidden_size=32, glu=True, act=ActFnConfig("silu"))


class LossRecorder(LoggerDestination):
    """Every batch's ``loss/train/total`` (the same on every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if "loss/train/total" in metrics:
            self.losses.append(float(metrics["loss/train/total"]))


class BatchTimes(Callback):
    """Wall time at each BATCH_END, after the device finished the batch."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        torch.cuda.synchronize()
        self.times_s.append(time.perf_counter())


def layer_rows(tokens: int = 4096) -> list[dict[str, Any]]:
    """The OLMoE layer, grouped GEMM against the per-expert loop."""
    torch.manual_seed(0)
    moe = MoE(2048, OLMOE_LAYER).cuda()
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    x = torch.randn(1, tokens, 2048, device="cuda", requires_grad=True)
    outputs, rows = {}, []
    for name, use_grouped_mm in (("grouped_mm", None), ("per_expert_loop", False)):
        moe.experts.use_grouped_mm = use_grouped_mm

        def step() -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = moe(x)
            out.float().square().mean().backward()
            return out

        outputs[name] = step().detach().float()
        times = sorted(cuda_time_ms(step, warmup=3, iters=20))
        rows.append({"variant": name, "tokens": tokens, "median_ms_fwd_bwd": round(times[len(times) // 2], 3)})
    loop_ms = rows[1]["median_ms_fwd_bwd"]
    rows[0]["speedup_vs_loop"] = round(loop_ms / rows[0]["median_ms_fwd_bwd"], 2)
    scale = outputs["per_expert_loop"].abs().max().item()
    rows[0]["max_abs_diff_vs_loop"] = (outputs["grouped_mm"] - outputs["per_expert_loop"]).abs().max().item()
    rows[0]["output_max_abs"] = scale
    return rows


def train_row(overrides: list[str], microbatch: int, seq_len: int, batches: int, warmup: int) -> dict[str, Any]:
    """Train the YAML's model (with ``overrides``) on random tokens through the Trainer; throughput and MFU."""
    cfg, _ = load_train_config(OLMOE_YAML, [f"variables.max_seq_len={seq_len}", *overrides])
    data = [random_batch(microbatch, seq_len, cfg.model["vocab_size"], torch.device("cpu")) for _ in range(4)]
    times = BatchTimes()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    trainer = yaml_trainer(cfg, (data * (batches // 4 + 1))[:batches], microbatch, [times], device=device)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.fit()
    measured = times.times_s[warmup:]
    seconds = (measured[-1] - measured[0]) / (len(measured) - 1)
    model = trainer.state.model
    peak = peak_flops_per_sec(torch.cuda.get_device_name(device), "bf16")
    return {
        "gpus": get_world_size(),
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "active_params_M": round(model.n_active_params / 1e6, 1),
        "tokens_per_gpu_per_batch": microbatch * seq_len,
        "s_per_batch": round(seconds, 4),
        "tokens_per_s_per_gpu": round(microbatch * seq_len / seconds, 1),
        "mfu_active": round(model.flops_per_batch(data[0]) / seconds / peak, 4) if peak else None,
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
    }


def text_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of ``steps`` global batches of real text: Python's help topics, a 4,096-token BPE."""
    from foundry.data import builtin_corpus_documents, train_bpe_tokenizer

    documents = builtin_corpus_documents()
    tokenizer = train_bpe_tokenizer(documents, vocab_size=4096, out_dir=Path(tempfile.mkdtemp()))
    ids = torch.tensor([i for text in documents for i in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]])
    rows = ids[: ids.numel() // PARITY_SEQ_LEN * PARITY_SEQ_LEN].view(-1, PARITY_SEQ_LEN)  # ~250 rows of 512
    global_batch, rank = PARITY_MICROBATCH * get_world_size(), get_rank()
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))
    batches = []
    for step in range(steps):  # the corpus repeats in a new order each pass
        picks = torch.arange(step * global_batch, (step + 1) * global_batch) % rows.shape[0]
        mine = order[picks][rank * PARITY_MICROBATCH : (rank + 1) * PARITY_MICROBATCH]
        batches.append({"input_ids": rows[mine]})
    return batches


def parity_losses(overrides: list[str], steps: int) -> list[float]:
    """Per-step losses of the small MoE on real text, through the Trainer with the OLMoE YAML's settings."""
    cfg, _ = load_train_config(OLMOE_YAML, [f"variables.max_seq_len={PARITY_SEQ_LEN}", *PARITY_MODEL, *overrides])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    recorder = LossRecorder()
    trainer = yaml_trainer(cfg, text_batches(steps), PARITY_MICROBATCH, device=device, loggers=[recorder])
    trainer.fit()
    return recorder.losses


def parity_rows(steps: int, timeout_s: int, out: str | None = None) -> list[dict[str, Any]]:
    """EP1, EP2, EP1 again; each run's curve saved as it ends (``moe_parity_runs.json``), so a call that runs out
    of time keeps the runs before."""
    runs = {}
    for name, overrides in (("ep1_a", []), ("ep2", ["parallelism.expert_parallel_degree=2"]), ("ep1_b", [])):
        runs[name] = _torchrun(["--batches", str(steps), "--parity"], overrides, timeout_s).get("losses")
        save_json(out, "moe_parity_runs", [{"run": run, "losses": losses} for run, losses in runs.items()])
    if any(losses is None for losses in runs.values()):  # the runs that ended keep their curves
        return [
            {"run": name, "final_loss": round(losses[-1], 4), "losses": losses}
            if losses
            else {"run": name, "error": "failed (the log above says why)"}
            for name, losses in runs.items()
        ]

    def gap(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    return [
        {
            "steps": steps,
            "max_step_gap_ep2_vs_ep1": round(gap(runs["ep2"], runs["ep1_a"]), 5),
            "max_step_gap_ep1_vs_ep1": round(gap(runs["ep1_b"], runs["ep1_a"]), 5),
            "final_loss_ep1": [round(runs["ep1_a"][-1], 4), round(runs["ep1_b"][-1], 4)],
            "final_loss_ep2": round(runs["ep2"][-1], 4),
            "mean_last_20_ep1": round(sum(runs["ep1_a"][-20:]) / 20, 4),
            "mean_last_20_ep2": round(sum(runs["ep2"][-20:]) / 20, 4),
        }
    ]


def small_rows(batches: int) -> list[dict[str, Any]]:
    rows = []
    for name, overrides in (("moe 16x1408 top-2", SMALL_MOE), ("dense 2816", SMALL_DENSE)):
        rows.append({"model": name, **train_row(overrides, microbatch=8, seq_len=2048, batches=batches, warmup=4)})
    return rows


def olmoe_rows(batches: int, timeout_s: int) -> list[dict[str, Any]]:
    """Each layout in its own torchrun of two ranks (this script, ``--worker``)."""
    rows = []
    for layout, overrides in LAYOUTS:
        for checkpointing in (False, True):
            extra = [CHECKPOINTING] if checkpointing else []
            row = _torchrun(["--batches", str(batches)], [*overrides, *extra], timeout_s)
            rows.append({"layout": layout, "activation_checkpointing": checkpointing, **row})
            if "error" not in row or row["error"] == "timed out":  # a fast failure (out of memory) retries
                break
    return rows


def sweep_rows(
    out: str | None,
    timeout_s: int,
    smoke: bool,
    checkpointing: bool,
    layouts: Sequence[str],
    segments: Sequence[str] = (),
    settings: Sequence[str] = (),
    counts: dict[str, int | None] | None = None,
) -> list[dict[str, Any]]:
    """Each of ``layouts``' sweep in its own torchrun of two ranks (this script, ``--worker --sweep``).

    ``segments`` ("8x2": sequences per GPU per batch x per microbatch) replace SWEEP_SEGMENTS; ``settings``
    (YAML overrides) apply to every layout and are named in its label; ``counts`` (``batches_per_segment``)
    set each segment's warm-up, timed and profiled batches.
    """
    rows = []
    for name, overrides in (layout for layout in LAYOUTS if slug(layout[0]) in layouts):
        layout, overrides = (f"{name} + AC", [*overrides, CHECKPOINTING]) if checkpointing else (name, overrides)
        if settings:
            layout, overrides = f"{layout} + {' + '.join(settings)}", [*overrides, *settings]
        flags = ["--sweep", "--layout", layout, *(["--out", out] if out else []), *(["--smoke"] if smoke else [])]
        flags += ["--segments", *segments] if segments else []
        flags += [f"--{key}-batches={value}" for key, value in (counts or {}).items() if value is not None]
        # under out, so the finished segments' rows come back even if the whole command is stopped
        row_file = Path(out) / f"moe_sweep_{slug(layout)}_rows.json" if out else None
        result = _torchrun(flags, overrides, timeout_s, row_file)
        rows += result.get("rows", [])
        if "error" in result:  # out of memory ends a run: the rows before it came back
            rows.append({"layout": layout, "error": result["error"], "segments_done": len(result.get("rows", []))})
    return rows


def sweep_worker(args: argparse.Namespace) -> None:
    """One rank of a layout's sweep: its rows go to ``args.worker`` as each segment ends."""
    device = torch.device("cpu") if args.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    overrides = [*args.override, *(SMOKE_MODEL if args.smoke else ["variables.max_seq_len=4096"])]
    folder = Path(args.out or tempfile.mkdtemp()) / f"moe_profile_{slug(args.layout)}"
    small = {"segments": ((1, 1), (2, 1), (2, 2)), "warmup": 1, "timed": 1} if args.smoke else {}
    small.update({key: value for key, value in batches_per_segment(args).items() if value is not None})
    if args.segments:
        small["segments"] = tuple(parse_segment(text) for text in args.segments)
    sweep(OLMOE_YAML, overrides, args.layout, device, Path(args.worker), folder, **small)


def batches_per_segment(args: argparse.Namespace) -> dict[str, int | None]:
    """The sweep's batch counts given on the command line (None: the sweep's default)."""
    return {"warmup": args.warmup_batches, "timed": args.timed_batches, "profiled": args.profiled_batches}


def parse_segment(text: str) -> tuple[int, int]:
    """``"8x2"``: 8 sequences per GPU per batch, 2 per microbatch."""
    sequences, _, microbatch = text.partition("x")
    if not (sequences.isdigit() and microbatch.isdigit()) or int(sequences) % int(microbatch):
        raise SystemExit(f"--segments: {text!r} is not SxM with M dividing S (sequences per GPU, per microbatch)")
    return int(sequences), int(microbatch)


def slug(layout: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in layout.replace(" + ", "_")).lower()


def _torchrun(flags: list[str], overrides: list[str], timeout_s: int, row_file: Path | None = None) -> dict[str, Any]:
    """This script as a torchrun of two ranks (``--worker``): what rank 0 wrote, with ``error`` if it failed."""
    row_file = row_file or Path(tempfile.mkdtemp()) / "row.json"
    row_file.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    command += ["--worker", str(row_file), *flags, "--override", *overrides]
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    written = lambda: json.loads(row_file.read_text()) if row_file.exists() else {}  # noqa: E731
    try:
        result = subprocess.run(command, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {**written(), "error": "timed out"}
    if result.returncode != 0 or not row_file.exists():
        return {**written(), "error": f"exit code {result.returncode} (the log above says why)"}
    return written()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["layer", "small", "olmoe", "parity", "profile", "sweep"]
    parser.add_argument("--parts", nargs="+", choices=parts, default=["layer", "small", "olmoe"])
    parser.add_argument("--smoke", action="store_true", help="profile and sweep, tiny, on two CPU ranks")
    parser.add_argument("--sweep-timeout-s", type=int, default=230, help="each layout's sweep time limit")
    parser.add_argument("--checkpointing", action="store_true", help="the sweep with activation checkpointing")
    parser.add_argument("--segments", nargs="+", default=[], help="the sweep's SxM segments (default: SWEEP_SEGMENTS)")
    parser.add_argument("--set", nargs="+", default=[], help="YAML overrides for the sweep's layouts")
    parser.add_argument("--warmup-batches", type=int, help="the sweep's untimed batches per segment (default 3)")
    parser.add_argument("--timed-batches", type=int, help="the sweep's timed batches per segment (default 3)")
    parser.add_argument("--profiled-batches", type=int, choices=(0, 1), help="profile the first segment (default 1)")
    layouts = [slug(name) for name, _ in LAYOUTS]
    parser.add_argument("--layouts", nargs="+", choices=layouts, default=layouts, help="the sweep's layouts")
    parser.add_argument("--parity-steps", type=int, default=200)
    parser.add_argument("--parity", action="store_true", help=argparse.SUPPRESS)  # a torchrun rank of the parity part
    parser.add_argument("--batches", type=int, default=12, help="batches per one-GPU training row (4 untimed)")
    parser.add_argument("--olmoe-batches", type=int, default=8, help="batches per two-GPU row (4 untimed)")
    parser.add_argument("--row-timeout-s", type=int, default=200, help="each two-GPU row's time limit")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a torchrun rank: write its row here
    parser.add_argument("--override", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)  # a torchrun rank of the sweep
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.sweep:
        sweep_worker(args)
        return 0
    if args.worker and args.parity:
        losses = parity_losses(args.override, args.batches)
        if get_rank() == 0:
            Path(args.worker).write_text(json.dumps({"losses": losses}))
        return 0
    if args.worker:
        row = train_row(args.override, microbatch=1, seq_len=4096, batches=args.batches, warmup=4)
        if get_rank() == 0:
            Path(args.worker).write_text(json.dumps(row))
        return 0
    if "profile" in args.parts:
        device, (token_counts, d_model, layer) = (
            (torch.device("cpu"), ((64, 128), 64, SMOKE_LAYER))
            if args.smoke
            else (torch.device("cuda"), ((4096, 16384), 2048, OLMOE_LAYER))  # 16,384: a microbatch of 4
        )
        rows = layer_profile(device, token_counts, d_model, layer)
        save_json(args.out, "moe_profile_layer", rows)
        print(markdown_table([{**row.pop("profile")["ms"], **row} for row in rows]))  # kernel ms by category
        torch._dynamo.reset()  # the compiled layer's cache holds its weights and gradients
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the sweep's ranks need the whole GPU
    if "sweep" in args.parts:
        rows = sweep_rows(
            args.out,
            args.sweep_timeout_s,
            args.smoke,
            args.checkpointing,
            args.layouts,
            args.segments,
            args.set,
            batches_per_segment(args),
        )
        label = ("_ac" if args.checkpointing else "") + (f"_{slug('_'.join(args.set))}" if args.set else "")
        name = f"moe_sweep{label}"
        write_results(args.out, name, rows)
    if "layer" in args.parts:
        write_results(args.out, "moe_layer", layer_rows())
    if "olmoe" in args.parts:  # before the small pair: each part's JSON is written as it ends
        write_results(args.out, "moe_olmoe", olmoe_rows(args.olmoe_batches, args.row_timeout_s))
    if "small" in args.parts:
        write_results(args.out, "moe_small", small_rows(args.batches))
    if "parity" in args.parts:
        write_results(args.out, "moe_parity", parity_rows(args.parity_steps, 3 * args.row_timeout_s, args.out))
    print(json.dumps(environment()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
