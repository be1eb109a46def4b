"""Long context on two GPUs: tokens/s per GPU, MFU and peak memory with and without context parallelism.

    python benchmarks/long_context.py --out $OUT        # two GPUs, about 9 minutes; rows in priority order
    python benchmarks/long_context.py --rows llama8b-16k llama8b-16k-repeat llama8b-16k-cp2 \
        --loss-steps 50 --budget-s 540 --plot $OUT/long_context_loss.png --out $OUT    # the loss check alone

The script launches itself on 2 ranks through torchrun (what ``foundry train --nproc 2`` runs) and trains each
row through the Trainer that ``foundry train`` builds from the shipped YAML (its model, optimizer with bf16
moments, schedule, gradient clipping, FSDP2 and activation checkpointing, compile, precision), with
``variables.max_seq_len`` and ``parallelism.context_parallel_degree`` overridden and the batches in memory
(the GPU image lacks mosaicml-streaming for the ``text`` loader). Weights are initialised on the GPU
(``model.init_device=cuda``; the same seed on both ranks) to save the minute rank 0 would spend on 8B CPU init.

Rows (``--rows`` picks; each is skipped when the time left in ``--budget-s`` is below its estimate):

- ``llama8b-64k-cp2``: ``yamls/pretrain/llama-8b-64k.yaml`` as shipped: 65,536 tokens, CP2.
- ``llama8b-64k-cp2-keep-attention``: the same with ``fsdp_config.activation_checkpointing_keep_attention``
  (backward recomputes each block but its attention kernel; about 8 GiB more a GPU, docs/DISTRIBUTED.md).
- ``llama8b-128k-cp2``: the same YAML at 131,072 tokens, CP2 (by the memory arithmetic near an 80 GB card's
  limit: its peak, or the out-of-memory error, is the measurement).
- ``llama8b-16k``, ``llama8b-16k-repeat`` and ``llama8b-16k-cp2``: the same model at 16,384 tokens on the same
  real-text batches for ``--loss-steps`` steps: FSDP only, FSDP only again (same seed: the run-to-run spread of
  bf16 training) and CP2. ``llama8b-16k-reduce-fp32`` is FSDP only with gradients reduced in fp32 instead of
  bf16 (``fsdp_config.mixed_precision=DEFAULT``): a change at the rounding level, for how far rounding alone
  moves this run. The JSON compares each with ``llama8b-16k`` step by step; ``--plot`` draws the curves and
  their differences (``--replot JSON`` draws them from a saved JSON where the GPU machine lacks matplotlib).
- ``mpt1b-8k`` ... ``mpt1b-128k-cp2``: ``yamls/pretrain/mpt-1b.yaml`` (learned positions, no ALiBi) from 8k to
  128k tokens, activation checkpointing from 32k.

``OPT_IN_ROWS`` (keep-attention, 128k, fp32 reduction) run only when ``--rows`` names them.

Text: the corpus files (``--corpus``, default ../shared/data/corpus) tokenized with ``--tokenizer`` (default
the shared gpt-neox-20b); random tokens when neither is there (the JSON says which). MFU is the speed
monitor's: LLM Foundry's formula over each rank's loaded sequences at their whole length (docs/MODELS.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_utils import (
    REPO_ROOT,
    SHARED_DATA,
    environment,
    markdown_table,
    plot_against_reference,
    save_json,
    yaml_trainer,
)

from foundry import Callback
from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.config import load_train_config
from foundry.core import LoggerDestination
from foundry.distributed import get_rank, get_world_size, init_process_group
from foundry.errors import FoundryError

LLAMA_8B_64K = "yamls/pretrain/llama-8b-64k.yaml"
MPT_1B = "yamls/pretrain/mpt-1b.yaml"
# name -> (YAML, tokens a sequence, context-parallel degree, steps, untimed steps, estimated seconds on 2 H100s);
# the loss rows' steps and seconds follow --loss-steps (LOSS_ROWS)
ROWS: dict[str, tuple[str, int, int, int, int, int]] = {
    "llama8b-64k-cp2": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    "llama8b-64k-cp2-keep-attention": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    # 64k: 24 s a batch, about half of it attention; at 128k attention quadruples and the rest doubles (~72 s)
    "llama8b-128k-cp2": (LLAMA_8B_64K, 131072, 2, 3, 1, 300),
    "llama8b-128k-cp2-lora": (LLAMA_8B_64K, 131072, 2, 3, 1, 260),
    "llama8b-16k": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "llama8b-16k-repeat": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "llama8b-16k-cp2": (LLAMA_8B_64K, 16384, 2, 20, 2, 110),
    "llama8b-16k-reduce-fp32": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "mpt1b-8k": (MPT_1B, 8192, 1, 5, 2, 30),
    "mpt1b-32k": (MPT_1B, 32768, 1, 4, 2, 35),
    "mpt1b-64k-cp2": (MPT_1B, 65536, 2, 4, 2, 45),
    "mpt1b-128k-cp2": (MPT_1B, 131072, 2, 4, 2, 70),
}
# the 16k loss rows: seconds a step on 2 H100s (2026-11-26 JSON)
LOSS_ROWS: dict[str, float] = {
    "llama8b-16k": 2.45,
    "llama8b-16k-repeat": 2.45,
    "llama8b-16k-cp2": 3.18,
    "llama8b-16k-reduce-fp32": 2.45,
}
# a row's overrides of its YAML beyond the length and the degree
ROW_OVERRIDES: dict[str, list[str]] = {
    "llama8b-64k-cp2-keep-attention": ["fsdp_config.activation_checkpointing_keep_attention=true"],
    "llama8b-16k-reduce-fp32": ["fsdp_config.mixed_precision=DEFAULT"],
    # LoRA on every linear layer: frozen weights need no fp32 gradients or moments, which frees 128k's activations
    "llama8b-128k-cp2-lora": [
        "model.peft_config={peft_type: LORA, r: 16, lora_alpha: 32, lora_dropout: 0.0, "
        "target_modules: [Wqkv, out_proj, gate_proj, up_proj, down_proj]}"
    ],
}
# opt-in rows (--rows names them): not part of a default call's budget
OPT_IN_ROWS = ("llama8b-64k-cp2-keep-attention", "llama8b-128k-cp2", "llama8b-128k-cp2-lora", "llama8b-16k-reduce-fp32")
LOSS_REFERENCE = "llama8b-16k"
ROW_SETUP_S = 25  # building the 8B model on the GPUs, FSDP, the first batch


class BatchTimes(Callback):
    """Wall time at FIT_START and at each BATCH_END, once the device finished the batch."""

    def __init__(self) -> None:
        self.fit_start_s = 0.0
        self.times_s: list[float] = []

    def fit_start(self, state, logger) -> None:
        self.fit_start_s = time.perf_counter()

    def batch_end(self, state, logger) -> None:
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        self.times_s.append(time.perf_counter())


class Losses(LoggerDestination):
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if "loss/train/total" in metrics:
            self.by_step[step] = float(metrics["loss/train/total"])


def token_stream(args: argparse.Namespace, vocab_size: int) -> tuple[torch.Tensor, str]:
    """The corpus as one stream of token ids (every rank the same), or random ids when there is no corpus."""
    files = sorted(Path(args.corpus).rglob("*.txt")) if args.corpus and Path(args.corpus).exists() else []
    if files and Path(args.tokenizer).exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        text = "\n\n".join(path.read_text() for path in files)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long) % vocab_size, f"{len(files)} files of {args.corpus}"
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (4_000_000,), generator=generator), "random tokens"


def rank_batches(stream: torch.Tensor, seq_len: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """This rank's sample of each step (global batch 2, one sample a rank), cut from the stream in order."""
    rank, world_size = get_rank(), get_world_size()
    batches = []
    for step in range(steps):
        start = ((step * world_size + rank) * seq_len) % max(1, stream.numel() - seq_len)
        batches.append({"input_ids": stream[start : start + seq_len][None].clone()})
    return batches


def steps_and_estimate_s(name: str, args: argparse.Namespace) -> tuple[int, float]:
    """How many steps row ``name`` trains and about how many seconds it takes on 2 H100s."""
    if name in LOSS_ROWS:
        return args.loss_steps, ROW_SETUP_S + args.loss_steps * LOSS_ROWS[name]
    return ROWS[name][3], ROWS[name][5]


def run_row(name: str, args: argparse.Namespace, stream_cache: dict) -> dict[str, Any]:
    yaml_path, seq_len, cp, _, warmup, _ = ROWS[name]
    steps, _ = steps_and_estimate_s(name, args)
    overrides = [f"parallelism.context_parallel_degree={cp}", *ROW_OVERRIDES.get(name, [])]
    if yaml_path == MPT_1B:
        overrides.append(f"fsdp_config.activation_checkpointing={str(seq_len >= 32768).lower()}")
    trainer_overrides: dict[str, Any] = {}
    if args.smoke:  # the same rows, tiny, on CPU ranks: checks the script, not the speed
        seq_len //= 512
        overrides += ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=512"]
        overrides += ["model.kv_n_heads=2"] if yaml_path == LLAMA_8B_64K else []
        trainer_overrides = {"device": "cpu", "precision": "fp32", "compile_config": False}
    overrides += [f"variables.max_seq_len={seq_len}", f"model.init_device={'cpu' if args.smoke else 'cuda'}"]
    cfg, _ = load_train_config(REPO_ROOT / yaml_path, overrides)
    vocab_size = cfg.model["vocab_size"]
    if vocab_size not in stream_cache:
        stream_cache[vocab_size] = token_stream(args, vocab_size)
    stream, data = stream_cache[vocab_size]
    batches = rank_batches(stream, seq_len, steps)
    times, losses = BatchTimes(), Losses()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(cfg.seed)  # the model is built before the Trainer seeds: the same weights on every rank
    trainer = yaml_trainer(cfg, batches, microbatch=1, callbacks=[times], loggers=[losses], **trainer_overrides)
    trainer.fit()
    timed = times.times_s[warmup:]
    seconds_per_batch = (timed[-1] - timed[0]) / (len(timed) - 1)
    flops_per_gpu = trainer.state.model.flops_per_batch(batches[0])  # one whole sequence a rank
    peak = peak_flops_per_sec(torch.cuda.get_device_name(), "bf16") if torch.cuda.is_available() else None
    row = {
        "row": name,
        "yaml": yaml_path,
        "seq_len": seq_len,
        "context_parallel_degree": cp,
        "activation_checkpointing": cfg.fsdp_config.activation_checkpointing,
        "keep_attention": cfg.fsdp_config.activation_checkpointing_keep_attention,
        "optimizer_moments": cfg.optimizer.get("moments_dtype", "float32"),
        "tokens_per_s_per_gpu": round(seq_len / seconds_per_batch, 1),
        "mfu": round(flops_per_gpu / seconds_per_batch / peak, 4) if peak else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "s_per_batch": round(seconds_per_batch, 3),
        "first_batch_s": round(times.times_s[0] - times.fit_start_s, 1),
        "timed_batches": len(timed) - 1,
        "losses": losses.by_step,
        "data": data,
    }
    del trainer
    free_memory()
    return row


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker(args: argparse.Namespace) -> None:
    init_process_group()
    started_s, rows, stream_cache = time.perf_counter(), [], {}
    for name in args.rows:
        left_s = args.budget_s - (time.perf_counter() - started_s)
        needed_s = steps_and_estimate_s(name, args)[1]
        if left_s < needed_s:
            rows.append({"row": name, "skipped": f"{left_s:.0f} s left of --budget-s, row needs ~{needed_s:.0f} s"})
            continue
        try:
            rows.append(run_row(name, args, stream_cache))
        except Exception as error:  # a row that fails (out of memory) leaves the others their time
            rows.append({"row": name, "error": f"{type(error).__name__}: {str(error)[:400]}"})
            free_memory()
        if get_rank() == 0:  # after each row: a call cut off keeps the rows (and losses) that ran
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
            write(args.out, rows)
    if get_rank() == 0 and args.plot:
        plot_losses(rows, args.plot)


def write(out: str | None, rows: list[dict[str, Any]]) -> None:
    """The rows so far and the 16k loss comparisons as JSON under ``out``: a cut-off call keeps what ran."""
    save_json(out, "long_context", rows + loss_comparisons(rows))
    if out:
        table = [{k: v for k, v in row.items() if k not in ("losses", "yaml")} for row in rows]
        Path(out, "long_context.md").write_text(markdown_table(table) + "\n")


def loss_comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each 16k loss row against FSDP alone (``llama8b-16k``), step by step, same batches."""
    by_name = {row["row"]: row for row in rows if "losses" in row}
    if LOSS_REFERENCE not in by_name:
        return []
    reference = {int(step): loss for step, loss in by_name[LOSS_REFERENCE]["losses"].items()}
    comparisons = []
    for name in [name for name in LOSS_ROWS if name != LOSS_REFERENCE and name in by_name]:
        losses = {int(step): loss for step, loss in by_name[name]["losses"].items()}
        steps = sorted(set(reference) & set(losses))
        differences = [abs(losses[step] - reference[step]) for step in steps]
        last = differences[-10:]
        comparisons.append({
            "row": f"{name} against {LOSS_REFERENCE}",
            "steps": len(steps),
            "max_abs_loss_difference": max(differences) if steps else None,
            "mean_abs_loss_difference_last_10_steps": sum(last) / len(last) if steps else None,
            "identical": differences == [0.0] * len(steps),
        })  # fmt: skip
    return comparisons


def plot_losses(rows: list[dict[str, Any]], path: str) -> None:
    """The 16k loss rows' curves (top) and each one's difference from FSDP alone (bottom)."""
    curves = {row["row"]: {int(s): v for s, v in row["losses"].items()} for row in rows if row["row"] in LOSS_ROWS}
    if not curves.get(LOSS_REFERENCE):
        print(f"no plot: the {LOSS_REFERENCE} row has no losses", flush=True)
        return
    titles = ("Llama-3.1-8B shape, 16,384 tokens, 2 GPUs: train loss on the same batches", "difference from FSDP alone")
    try:
        plot_against_reference(curves, LOSS_REFERENCE, path, titles)
    except FoundryError as error:  # no matplotlib on this machine: --replot the JSON elsewhere
        print(f"no plot: {error}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_rows = [name for name in ROWS if name not in OPT_IN_ROWS]
    parser.add_argument("--rows", nargs="*", default=default_rows, choices=list(ROWS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=500.0, help="rows that would not fit are skipped")
    parser.add_argument("--loss-steps", type=int, default=20, help="steps of each 16k loss row")
    parser.add_argument("--plot", default=None, help="PNG of the 16k loss rows' curves and differences")
    parser.add_argument("--replot", default=None, help="only draw --plot from this saved long_context.json")
    parser.add_argument("--corpus", default=str(SHARED_DATA / "corpus"))
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "tokenizers" / "gpt-neox-20b"))
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU ranks: checks the script runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set on the torchrun ranks
    args = parser.parse_args()
    if args.replot:
        plot_losses(json.loads(Path(args.replot).read_text())["rows"], args.plot)
        return 0
    if args.worker:
        worker(args)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    command += [__file__, "--worker", "--rows", *args.rows, "--budget-s", str(args.budget_s)]
    command += ["--loss-steps", str(args.loss_steps)] + (["--plot", args.plot] if args.plot else [])
    command += ["--corpus", args.corpus, "--tokenizer", args.tokenizer] + (["--out", args.out] if args.out else [])
    command += ["--smoke"] if args.smoke else []
    here = Path(__file__).resolve().parent
    pythonpath = os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": pythonpath})
    if args.out and Path(args.out, "long_context.md").exists():
        print(Path(args.out, "long_context.md").read_text())
    print(json.dumps(environment()))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
