"""Model FLOPs utilisation of whole training steps: foundry's configs and a plain-PyTorch HF Llama baseline.

    python benchmarks/mfu.py --rows mpt-125m mpt-125m-fast mpt-1b mpt-1b-fast hf-llama hf-llama-compiled --out OUT
    python benchmarks/mfu.py --rows mpt-1b-fast --profile --out OUT   # + where the time goes

One process, one CUDA device. Each row trains for ``--warmup`` then ``--steps`` batches of random
tokens (``--accum`` microbatches per batch): forward, backward, optimizer. foundry rows run through
the real ``Trainer`` built from the row's YAML (its optimizer, precision, fsdp_config and
algorithms, plus the row's), fed by an in-memory loader (``foundry.data`` needs mosaicml-streaming).
The baseline is the loop everyone writes: ``transformers.LlamaForCausalLM`` (~1.4B parameters),
bf16 autocast, SDPA, fused ``torch.optim.AdamW``, eager or ``torch.compile``d.

Time is GPU time between CUDA events at the ends of the first and last timed batch; FLOPs are
LLM Foundry's formula (``foundry.models.flops``, the same for the baseline); MFU is against
989.5 TFLOP/s (H100 SXM dense bf16) unless ``--peak-tflops`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
from bench_utils import REPO_ROOT, markdown_table, save_json
from profile_summary import profile_loop, recorded_event

from foundry import Callback, registry
from foundry.callbacks import Profiler
from foundry.config import load_train_config
from foundry.models import flops
from foundry.models.build import build_model
from foundry.registry import build_components, component_factory
from foundry.trainer import Trainer

H100_BF16_PEAK_TFLOPS = 989.5


@dataclasses.dataclass
class Row:
    """A foundry YAML with a microbatch size and extra algorithms, or (``config=None``) the HF baseline."""

    config: str | None
    microbatch: int
    algorithms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    use_fsdp_config: bool = True  # as `foundry train` runs the YAML (FSDP2 on one rank)
    compiled: bool = False  # HF baseline only


FAST = {"torch_compile": {"compile_loss": True}}
SDPA = ("model.attn_config.attn_impl=sdpa",)
FUSED_CE = ("model.loss_fn=fused_crossentropy",)
WHOLE = {"torch_compile": {"scope": "model"}}
WHOLE_CD = {"torch_compile": {"scope": "model", "options": {"coordinate_descent_tuning": True}}}
RESIDUAL = {"low_precision_residual": {}}


def fast(
    config: str, microbatch: int, use_fsdp_config: bool = False, fused_ce: bool = False, residual: bool = False
) -> Row:
    """The YAML with regional compile and SDPA; on one device without its fsdp_config.

    The loss is compiled too, or with ``fused_ce`` computed by the chunked linear + cross-entropy
    kernel; ``residual`` adds the ``low_precision_residual`` algorithm (bf16 residual stream, as
    the YAML's FSDP ``mixed_precision: PURE`` has).
    """
    algorithms = {"torch_compile": {}} if fused_ce else dict(FAST)
    if residual:
        algorithms.update(RESIDUAL)
    return Row(config, microbatch, algorithms, SDPA + FUSED_CE if fused_ce else SDPA, use_fsdp_config)


MPT_125M, MPT_1B, LLAMA_1B = (f"yamls/pretrain/{name}.yaml" for name in ("mpt-125m", "mpt-1b", "llama-1b"))
ROWS: dict[str, Row] = {
    "mpt-125m": Row(MPT_125M, microbatch=16),
    "mpt-125m-fast": fast(MPT_125M, microbatch=16),
    "mpt-125m-fast-mb32": fast(MPT_125M, microbatch=32),
    "mpt-125m-fused-mb32": fast(MPT_125M, microbatch=32, fused_ce=True),
    "mpt-125m-fused-mb64": fast(MPT_125M, microbatch=64, fused_ce=True),
    "mpt-125m-autotune-mb32": Row(
        MPT_125M, 32, {"torch_compile": {"compile_loss": True, "mode": "max-autotune-no-cudagraphs"}}, SDPA, False
    ),
    "mpt-125m-fast-fsdp": fast(MPT_125M, microbatch=16, use_fsdp_config=True),
    "mpt-125m-fast-fsdp-mb32": fast(MPT_125M, microbatch=32, use_fsdp_config=True),
    "mpt-125m-residual-mb32": fast(MPT_125M, microbatch=32, residual=True),
    "mpt-125m-fused-residual-mb32": fast(MPT_125M, microbatch=32, fused_ce=True, residual=True),
    "mpt-125m-fused-residual-mb64": fast(MPT_125M, microbatch=64, fused_ce=True, residual=True),
    # The fastest MPT-125M setup (benchmarks/results/HISTORY.md): whole-model compile with coordinate
    # descent, the fused loss, a bf16 residual stream, microbatch 96 or 112 (68 GiB; 128 gains nothing).
    "mpt-125m-fastest-mb112": Row(MPT_125M, 112, {**WHOLE_CD, **RESIDUAL}, SDPA + FUSED_CE, use_fsdp_config=False),
    "mpt-125m-fastest-mb96": Row(MPT_125M, 96, {**WHOLE_CD, **RESIDUAL}, SDPA + FUSED_CE, use_fsdp_config=False),
    "mpt-125m-whole-fused-residual-mb96": Row(MPT_125M, 96, {**WHOLE, **RESIDUAL}, SDPA + FUSED_CE, False),
    "mpt-125m-whole-fused-residual-mb112": Row(MPT_125M, 112, {**WHOLE, **RESIDUAL}, SDPA + FUSED_CE, False),
    "mpt-1b": Row(MPT_1B, microbatch=4),
    "mpt-1b-nofsdp": Row(MPT_1B, microbatch=4, use_fsdp_config=False),
    "mpt-1b-fused-ce": Row(MPT_1B, microbatch=4, overrides=FUSED_CE),
    "mpt-1b-fast": fast(MPT_1B, microbatch=4),
    "mpt-1b-fast-mb6": fast(MPT_1B, microbatch=6),
    "mpt-1b-fast-mb8": fast(MPT_1B, microbatch=8),
    "mpt-1b-fused-residual-mb8": fast(MPT_1B, microbatch=8, fused_ce=True, residual=True),
    "mpt-1b-whole-fused-residual-mb8": Row(MPT_1B, 8, {**WHOLE, **RESIDUAL}, SDPA + FUSED_CE, False),
    "mpt-1b-fused-mb8": fast(MPT_1B, microbatch=8, fused_ce=True),
    # What `foundry train` picks for the YAML on one GPU (compile_config's whole-model compile, spelled out:
    # the Trainer alone does not compile; its fsdp_config skipped on one rank), with and without float8.
    "mpt-1b-default-mb8": Row(MPT_1B, 8, WHOLE),
    "mpt-1b-float8-mb8": Row(MPT_1B, 8, {"float8": {}, **WHOLE}),
    "mpt-1b-float8-all-blocks-mb8": Row(MPT_1B, 8, {"float8": {"keep_first_and_last_blocks": False}, **WHOLE}),
    "mpt-1b-float8-rowwise-mb8": Row(MPT_1B, 8, {"float8": {"recipe": "rowwise"}, **WHOLE}),
    "mpt-1b-fused-mb12": fast(MPT_1B, microbatch=12, fused_ce=True),
    "mpt-1b-fast-fsdp": fast(MPT_1B, microbatch=4, use_fsdp_config=True),
    "llama-1b": Row(LLAMA_1B, microbatch=4),
    "llama-1b-fast": fast(LLAMA_1B, microbatch=4),
    "llama-1b-fused-mb8": fast(LLAMA_1B, microbatch=8, fused_ce=True),
    "hf-llama": Row(None, microbatch=4),
    "hf-llama-compiled": Row(None, microbatch=4, compiled=True),
}
# ~1.4B parameters: Llama-3.2-1B's widths with a Llama-2-sized vocabulary and untied output head.
HF_LLAMA_CONFIG = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "rope_theta": 500000.0,
}  # fmt: skip


class StepEvents(Callback):
    """A CUDA event at every BATCH_END."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def batch_end(self, state, logger) -> None:
        self.events.append(recorded_event())


def random_batches(count: int, batch_size: int, seq_len: int, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """Pinned host batches, as a DataLoader with pin_memory gives them."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, seq_len)
    return [{"input_ids": torch.randint(0, vocab_size, shape, generator=generator).pin_memory()} for _ in range(count)]


def run_foundry_row(row: Row, args: argparse.Namespace) -> tuple[list[float], int, int, dict | None]:
    """Train through the Trainer; returns per-batch ms, FLOPs per batch, tokens per batch and a step function."""
    cfg, _ = load_train_config(REPO_ROOT / row.config, list(row.overrides))
    model = build_model(cfg.model)
    batch_size, seq_len = row.microbatch * args.accum, cfg.max_seq_len
    timed_batches = args.warmup + args.steps
    num_batches = timed_batches + (args.profile_steps if args.profile else 0)
    events = StepEvents()
    profiler = Profiler(skip_batches=timed_batches, batches=args.profile_steps, trace=False)
    trainer = Trainer(
        model=model,
        train_dataloader=random_batches(num_batches, batch_size, seq_len, model.config.vocab_size),
        max_duration=f"{num_batches}ba",
        optimizers=component_factory(registry.optimizers, cfg.optimizer, "optimizer", supplied=("params",)),
        algorithms=build_components(registry.algorithms, {**cfg.algorithms, **row.algorithms}, "algorithms"),
        callbacks=[events, profiler] if args.profile else [events],
        precision=cfg.precision,
        device="cuda",
        fsdp_config=cfg.fsdp_config if row.use_fsdp_config else None,
        device_train_microbatch_size=row.microbatch,
        log_to_console=False,
        console_log_interval=f"{num_batches + 1}ba",
        run_folder=tempfile.mkdtemp(prefix="mfu-"),
    )
    trainer.fit()
    torch.cuda.synchronize()
    timed = events.events[args.warmup - 1 : timed_batches]
    step_ms = [start.elapsed_time(end) for start, end in itertools.pairwise(timed)]
    flops_per_batch = trainer.state.model.flops_per_batch({"input_ids": torch.empty(batch_size, seq_len)})
    return step_ms, flops_per_batch, batch_size * seq_len, profiler.summary


def run_hf_row(row: Row, args: argparse.Namespace) -> tuple[list[float], int, int, dict | None]:
    """The plain loop: autocast forward with the loss, backward, fused AdamW, zero_grad."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**HF_LLAMA_CONFIG, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    seq_len = HF_LLAMA_CONFIG["max_position_embeddings"]
    forward = torch.compile(model) if row.compiled else model
    batches = random_batches(args.accum, row.microbatch, seq_len, config.vocab_size)
    batches = [batch["input_ids"].cuda(non_blocking=True) for batch in batches]

    def step() -> None:
        for input_ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(input_ids=input_ids, labels=input_ids).loss / len(batches)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    marks = [recorded_event()]
    for _ in range(args.steps):
        step()
        marks.append(recorded_event())
    torch.cuda.synchronize()
    step_ms = [start.elapsed_time(end) for start, end in itertools.pairwise(marks)]
    n_active = flops.active_params(model, model.model.embed_tokens, tie_word_embeddings=False)
    batch_size = row.microbatch * args.accum
    # attention's width: heads × head_dim, which a config may set apart from hidden_size (Qwen3's 128 at width 2048)
    q_dim = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    flops_per_batch = flops.flops_per_batch(n_active, config.num_hidden_layers, q_dim, batch_size, seq_len)
    summary = profile_loop(step, args.profile_steps) if args.profile else None
    return step_ms, flops_per_batch, batch_size * seq_len, summary


def measure(name: str, row: Row, args: argparse.Namespace) -> dict[str, Any]:
    torch.cuda.reset_peak_memory_stats()
    started_s = time.perf_counter()
    runner = run_hf_row if row.config is None else run_foundry_row
    step_ms, flops_per_batch, tokens_per_batch, profile_summary = runner(row, args)
    mean_ms = sum(step_ms) / len(step_ms)
    tflops = flops_per_batch / mean_ms / 1e9
    result = {
        "row": name,
        "config": row.config or "hf LlamaForCausalLM" + (" compiled" if row.compiled else ""),
        "algorithms": ",".join(row.algorithms) or "-",
        "microbatch": row.microbatch,
        "accum": args.accum,
        "step_ms": mean_ms,
        "step_ms_min": min(step_ms),
        "tokens_per_s": tokens_per_batch / mean_ms * 1e3,
        "tflops": tflops,
        "mfu": tflops / args.peak_tflops,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "wall_s": time.perf_counter() - started_s,
        "step_ms_each": [round(ms, 2) for ms in step_ms],
    }
    if profile_summary is not None:
        result.update({f"{label}_share": share for label, share in profile_summary["share"].items()})
        result["idle_share"] = profile_summary["timeline"]["idle_ms"] / profile_summary["wall_ms"]
        result["profile"] = profile_summary
    return result


def run_rows(rows: dict[str, Row], args: argparse.Namespace, out_name: str) -> list[dict[str, Any]]:
    """Measure each row in turn, saving ``<out_name>.json`` after each; prints one table at the end."""
    results = []
    for name, row in rows.items():
        try:
            results.append(measure(name, row, args))
        except torch.OutOfMemoryError as error:
            results.append({"row": name, "error": f"out of memory: {str(error)[:120]}"})
        except Exception as error:  # one broken row must not lose the others' measurements
            traceback.print_exc()
            results.append({"row": name, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        save_json(args.out, out_name, results)
        print({key: value for key, value in results[-1].items() if key != "profile"}, flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    details = ("profile", "step_ms_each")
    print(markdown_table([{key: value for key, value in row.items() if key not in details} for row in results]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches (compile happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed batches")
    parser.add_argument("--accum", type=int, default=8, help="microbatches per batch (one optimizer step)")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS)
    parser.add_argument("--profile", action="store_true", help="profile a few more batches per row")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `foundry train` sets it
    if not torch.cuda.is_available():
        print("mfu.py needs a CUDA device.", file=sys.stderr)
        return 2
    run_rows({name: ROWS[name] for name in args.rows}, args, "mfu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
