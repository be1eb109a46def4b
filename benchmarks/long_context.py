"""Long context on two GPUs: tokens/s per GPU, MFU and peak memory with and without context parallelism.

    python benchmarks/long_context.py --out OUT_DIR        # two GPUs, about 9 minutes; rows in priority order

The loss check of CP2 against FSDP alone, 200 steps at 8,192 tokens, split over two GPU calls on the same
token file (written here, copied there; the GPU machine has no shared data folder), compared here:

    python benchmarks/long_context.py --prepare data/long_context/tokens.npy      # 3.3M tokens, 6.6 MB
    python benchmarks/long_context.py --rows llama8b-8k llama8b-8k-repeat --loss-steps 200 \
        --tokens data/long_context/tokens.npy --budget-s 515 --out OUT_DIR            # call 1
    python benchmarks/long_context.py --rows llama8b-8k-cp2 --loss-steps 200 \
        --tokens data/long_context/tokens.npy --budget-s 515 --out OUT_DIR            # call 2
    python benchmarks/long_context.py --compare CALL1/long_context.json CALL2/long_context.json \
        --plot docs/images/cp_loss.png --out OUT                                   # here

The script launches itself on 2 ranks through torchrun (what ``foundry train --nproc 2`` runs) and trains each
row through the Trainer that ``foundry train`` builds from the shipped YAML (its model, optimizer with bf16
moments, schedule, gradient clipping, FSDP2 and activation checkpointing, compile, precision), with
``variables.max_seq_len`` and ``parallelism.context_parallel_degree`` overridden and the batches in memory
(the GPU image lacks mosaicml-streaming for the ``text`` loader). Weights are initialised on the GPU
(``model.init_device=cuda``; the same seed on both ranks) to save the minute rank 0 would spend on 8B CPU init.

Rows (``--rows`` picks; each is skipped when the time left in ``--budget-s`` is below its estimate):

- ``llama8b-64k-cp2``: ``yamls/pretrain/llama-8b-64k.yaml`` as shipped: 65,536 tokens, CP2, checkpointed blocks
  keeping their attention outputs (``fsdp_config.activation_checkpointing_keep_attention``), its
  ``context_parallel_attention: auto`` (cuDNN split on a GPU); ``llama8b-64k-cp2-end-aligned``: the same with
  ``end_aligned`` (FlashAttention-2's end-aligned kernel for the chunks that see more keys than they hold).
- ``llama8b-64k-cp2-recompute-attention``: the same with attention recomputed in backward (plain checkpointing:
  about 8 GiB less a GPU, docs/DISTRIBUTED.md); ``llama8b-64k-cp2-float8``: the YAML with ``algorithms.float8``.
- ``llama8b-128k-cp2``: the same YAML at 131,072 tokens, CP2, attention recomputed (by the memory arithmetic
  over an 80 GB card's limit: its peak, or the out-of-memory error, is the measurement);
  ``llama8b-128k-cp2-lora``: the same with LoRA on every linear layer; ``...-lora-keep-attention`` keeps
  attention outputs as the YAML does (16 GiB more a GPU at 128k).
- ``llama8b-16k``, ``llama8b-16k-repeat`` and ``llama8b-16k-cp2``: the same model at 16,384 tokens on the same
  real-text batches for ``--loss-steps`` steps: FSDP only, FSDP only again (same seed: the run-to-run spread of
  bf16 training) and CP2. ``llama8b-16k-reduce-fp32`` is FSDP only with gradients reduced in fp32 instead of
  bf16 (``fsdp_config.mixed_precision=DEFAULT``): a change at the rounding level, for how far rounding alone
  moves this run. ``llama8b-8k``, ``-repeat`` and ``-cp2``: the same three at 8,192 tokens (about 1.1 and 1.4 s
  a step on two H100s, estimated from 16k's: a 200-step comparison fits two calls).
- Each group is compared with its FSDP-alone row step by step (max and mean |Δloss|; the repeat's max is the
  spread; CP2 passes within max(0.01, spread) when every row read the same batches: same token-stream
  digest, length and rank count). The JSON holds the comparison after each row, and a loss row's curve so far
  every 25 steps (a call cut off keeps it). ``--compare`` merges several calls' JSON and draws ``--plot``
  (here: the GPU image lacks matplotlib).
- ``mpt1b-8k`` ... ``mpt1b-128k-cp2``: ``yamls/pretrain/mpt-1b.yaml`` (learned positions, no ALiBi) from 8k to
  128k tokens, activation checkpointing from 32k.

``OPT_IN_ROWS`` (recompute-attention, float8, 128k, fp32 reduction, 8k) run only when ``--rows`` names them.

Text: ``--tokens`` (the uint16 .npy ``--prepare`` writes: the shared corpora, then the ICL passages once each,
gpt-neox-20b), else the corpus files (``--corpus``, default ../shared/data/corpus) tokenized with
``--tokenizer``, else random tokens (the JSON says which). Every step's global batch is one sequence a rank
cut from the stream in order (``rank_batches``): under CP2 the two ranks exchange their sequences, so a step
trains the same two sequences with and without CP. MFU is the speed
monitor's: LLM Foundry's formula over each rank's loaded sequences at their whole length (docs/MODELS.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_utils import (
    REPO_ROOT,
    SHARED_DATA,
    loss_gaps,
    markdown_table,
    plot_against_reference,
    print_report,
    run_on_ranks,
    save_json,
    yaml_trainer,
)

from foundry import Callback
from foundry.callbacks.device_flops import peak_flops_per_sec
from foundry.config import load_train_config
from foundry.core import LoggerDestination
from foundry.distributed import broadcast_object, get_rank, get_world_size, init_process_group
from foundry.errors import FoundryError

LLAMA_8B_64K = "yamls/pretrain/llama-8b-64k.yaml"
MPT_1B = "yamls/pretrain/mpt-1b.yaml"
# name -> (YAML, tokens a sequence, context-parallel degree, steps, untimed steps, estimated seconds on 2 H100s);
# the loss rows' steps and seconds follow --loss-steps (LOSS_ROWS)
ROWS: dict[str, tuple[str, int, int, int, int, int]] = {
    "llama8b-64k-cp2": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    "llama8b-64k-cp2-recompute-attention": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    "llama8b-64k-cp2-float8": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    "llama8b-64k-cp2-end-aligned": (LLAMA_8B_64K, 65536, 2, 4, 1, 150),
    # 64k: 24 s a batch, about half of it attention; at 128k attention quadruples and the rest doubles (~72 s)
    "llama8b-128k-cp2": (LLAMA_8B_64K, 131072, 2, 3, 1, 300),
    "llama8b-128k-cp2-lora": (LLAMA_8B_64K, 131072, 2, 3, 1, 260),
    "llama8b-128k-cp2-lora-keep-attention": (LLAMA_8B_64K, 131072, 2, 3, 1, 230),
    "llama8b-16k": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "llama8b-16k-repeat": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "llama8b-16k-cp2": (LLAMA_8B_64K, 16384, 2, 20, 2, 110),
    "llama8b-16k-reduce-fp32": (LLAMA_8B_64K, 16384, 1, 20, 2, 110),
    "llama8b-8k": (LLAMA_8B_64K, 8192, 1, 20, 2, 60),
    "llama8b-8k-repeat": (LLAMA_8B_64K, 8192, 1, 20, 2, 60),
    "llama8b-8k-cp2": (LLAMA_8B_64K, 8192, 2, 20, 2, 60),
    "mpt1b-8k": (MPT_1B, 8192, 1, 5, 2, 30),
    "mpt1b-32k": (MPT_1B, 32768, 1, 4, 2, 35),
    "mpt1b-64k-cp2": (MPT_1B, 65536, 2, 4, 2, 45),
    "mpt1b-128k-cp2": (MPT_1B, 131072, 2, 4, 2, 70),
}
# At 16k about a quarter of the 8B step is attention (by FLOPs 22%: 8·S·d per token and layer, recompute
# included, against 8 × 7.5e9 for the linear layers; its kernels run below the GEMMs' rate).
ATTENTION_SHARE_16K = 0.25


def half_length_step_s(step_s: float, attention_share: float = ATTENTION_SHARE_16K) -> float:
    """A step's seconds at half the sequence length (same sequences a step): linear parts halve, attention
    (quadratic in the length) quarters."""
    return step_s * ((1 - attention_share) / 2 + attention_share / 4)


# the loss rows: seconds a step on 2 H100s (16k: the 2026-11-26 JSON; 8k: estimated from it)
LOSS_ROWS: dict[str, float] = {
    "llama8b-16k": 2.45,
    "llama8b-16k-repeat": 2.45,
    "llama8b-16k-cp2": 3.18,
    "llama8b-16k-reduce-fp32": 2.45,
    "llama8b-8k": half_length_step_s(2.45),
    "llama8b-8k-repeat": half_length_step_s(2.45),
    "llama8b-8k-cp2": half_length_step_s(3.18),
}
# each comparison's reference (FSDP alone); the rows named "<reference>-..." are compared with it
LOSS_REFERENCES = ("llama8b-16k", "llama8b-8k")
LOSS_TOLERANCE = 0.01  # CP2 passes within max(this, the repeat's max |Δloss|)
PARTIAL_SAVE_STEPS = 25  # a loss row's curve so far is written this often: a call cut off keeps it
RECOMPUTE_ATTENTION = "fsdp_config.activation_checkpointing_keep_attention=false"
LORA_ALL_LINEAR = (
    "model.peft_config={peft_type: LORA, r: 16, lora_alpha: 32, lora_dropout: 0.0, "
    "target_modules: [Wqkv, out_proj, gate_proj, up_proj, down_proj]}"
)
# a row's overrides of its YAML beyond the length and the degree
ROW_OVERRIDES: dict[str, list[str]] = {
    "llama8b-64k-cp2-recompute-attention": [RECOMPUTE_ATTENTION],
    "llama8b-64k-cp2-float8": ["algorithms.float8={}"],  # torchao (foundry[float8]) on the GPU machine
    # the tail chunks on FlashAttention-2's end-aligned kernel instead of the YAML's cuDNN split (cp_attention.py)
    "llama8b-64k-cp2-end-aligned": ["parallelism.context_parallel_attention=end_aligned"],
    "llama8b-16k-reduce-fp32": ["fsdp_config.mixed_precision=DEFAULT"],
    # 128k: attention recomputed (kept outputs would add 16 GiB a GPU)
    "llama8b-128k-cp2": [RECOMPUTE_ATTENTION],
    # LoRA on every linear layer: frozen weights need no fp32 gradients or moments, which frees 128k's activations
    "llama8b-128k-cp2-lora": [RECOMPUTE_ATTENTION, LORA_ALL_LINEAR],
    "llama8b-128k-cp2-lora-keep-attention": [LORA_ALL_LINEAR],
}
# opt-in rows (--rows names them): not part of a default call's budget
OPT_IN_ROWS = (
    "llama8b-64k-cp2-recompute-attention",
    "llama8b-64k-cp2-float8", "llama8b-64k-cp2-end-aligned", "llama8b-128k-cp2", "llama8b-128k-cp2-lora",
    "llama8b-128k-cp2-lora-keep-attention", "llama8b-16k-reduce-fp32",
    "llama8b-8k", "llama8b-8k-repeat", "llama8b-8k-cp2",
)  # fmt: skip
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
    """The train loss by step; every ``save_every`` steps ``save`` gets the curve so far (rank 0 logs)."""

    def __init__(self, save: Callable[[dict[int, float]], None] | None = None, save_every: int = 0) -> None:
        self.by_step: dict[int, float] = {}
        self.save, self.save_every = save, save_every

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if "loss/train/total" in metrics:
            self.by_step[step] = float(metrics["loss/train/total"])
            if self.save and self.save_every and len(self.by_step) % self.save_every == 0:
                self.save(self.by_step)


def token_stream(args: argparse.Namespace, vocab_size: int) -> tuple[torch.Tensor, str]:
    """One stream of token ids (every rank the same): ``--tokens`` (what ``--prepare`` wrote), else the corpus
    tokenized here, else random ids."""
    if args.tokens:
        import numpy as np

        ids = torch.from_numpy(np.load(args.tokens).astype(np.int64))
        return ids % vocab_size, f"{Path(args.tokens).name}: {ids.numel():,} tokens"
    files = sorted(Path(args.corpus).rglob("*.txt")) if args.corpus and Path(args.corpus).exists() else []
    if files and Path(args.tokenizer).exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        text = "\n\n".join(path.read_text() for path in files)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long) % vocab_size, f"{len(files)} files of {args.corpus}"
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (4_000_000,), generator=generator), "random tokens"


def stream_digest(stream: torch.Tensor) -> str:
    """A short hash of the token stream: rows with the same digest, length and rank count saw the same batches."""
    return hashlib.sha256(stream.numpy().tobytes()).hexdigest()[:16]


def prepare_tokens(path: Path, tokens: int, shared_data: Path, tokenizer_dir: Path) -> dict[str, Any]:
    """Write ``tokens`` ids of distinct real text (the shared corpora, then the ICL passages, as
    ``float8_loss.py`` reads them) tokenized with ``tokenizer_dir``, as a uint16 .npy the GPU call carries."""
    import numpy as np
    from float8_loss import corpus_texts
    from transformers import AutoTokenizer

    text = "\n\n".join(corpus_texts(shared_data))[: tokens * 5]  # about 4 characters a token: spare text
    if not text:
        raise SystemExit(f"no text under {shared_data}/corpus or {shared_data}/icl: pass --shared-data")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])
    if ids.max() >= 2**16:
        raise SystemExit(f"{tokenizer_dir} has ids above 65,535: the uint16 token file cannot hold them")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, ids.astype(np.uint16))
    stream = torch.from_numpy(ids.astype(np.int64))
    return {"file": str(path), "tokens": int(ids.size), "megabytes": round(path.stat().st_size / 1e6, 1),
            "digest": stream_digest(stream), "tokenizer": tokenizer_dir.name}  # fmt: skip


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


def run_row(
    name: str, args: argparse.Namespace, stream_cache: dict, save_partial: Callable[[dict], None] | None = None
) -> dict[str, Any]:
    """Train row ``name``; ``save_partial`` gets the row's losses so far every ``PARTIAL_SAVE_STEPS`` steps."""
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
    identity = {"row": name, "seq_len": seq_len, "context_parallel_degree": cp, "world_size": get_world_size(),
                "data": data, "tokens_digest": stream_digest(stream)}  # fmt: skip
    partial = (
        (lambda by_step: save_partial({**identity, "partial": True, "losses": dict(by_step)})) if save_partial else None
    )
    times, losses = BatchTimes(), Losses(partial, PARTIAL_SAVE_STEPS if name in LOSS_ROWS else 0)
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
        **identity,
        "yaml": yaml_path,
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
    measured_s: dict[tuple, float] = {}  # wall seconds of a row already run, by what sets its speed
    for name in args.rows:
        left_s = args.budget_s - (time.perf_counter() - started_s)
        speed_key = (*ROWS[name][:3], *ROW_OVERRIDES.get(name, []))  # a repeat runs as long as its original
        needed_s = max(steps_and_estimate_s(name, args)[1], measured_s.get(speed_key, 0.0))
        if broadcast_object(left_s < needed_s):  # rank 0's clock decides for all: every rank runs the same rows
            rows.append({"row": name, "skipped": f"{left_s:.0f} s left of --budget-s, row needs ~{needed_s:.0f} s"})
        else:
            save_partial = (lambda partial: write(args.out, [*rows, partial])) if get_rank() == 0 else None
            row_started_s = time.perf_counter()
            try:
                rows.append(run_row(name, args, stream_cache, save_partial))
                measured_s[speed_key] = time.perf_counter() - row_started_s
            except Exception as error:  # a row that fails (out of memory) leaves the others their time
                rows.append({"row": name, "error": f"{type(error).__name__}: {str(error)[:400]}"})
                free_memory()
        if get_rank() == 0:  # after each row: a call cut off keeps the rows (and losses) that ran
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
            write(args.out, rows)
    if get_rank() == 0 and args.plot:
        plot_losses(rows, args.plot)


def write(out: str | None, rows: list[dict[str, Any]]) -> None:
    """The rows so far and the loss comparisons as JSON under ``out``: a cut-off call keeps what ran."""
    save_json(out, "long_context", rows + comparison_rows(compare_losses(rows)))
    if out:
        table = [{k: v for k, v in row.items() if k not in ("losses", "yaml")} for row in rows]
        Path(out, "long_context.md").write_text(markdown_table(table) + "\n")


def loss_group(name: str) -> str | None:
    """The reference row that loss row ``name`` is compared with (``llama8b-8k-cp2`` -> ``llama8b-8k``)."""
    return next((ref for ref in LOSS_REFERENCES if name == ref or name.startswith(f"{ref}-")), None)


def merge_rows(row_lists: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The loss rows of several calls' JSON by name, steps as ints; of two rows of one name, the longer curve
    (a call's partial save of a row, then its finished row)."""
    merged: dict[str, dict[str, Any]] = {}
    for rows in row_lists:
        for row in rows:
            if "losses" not in row:
                continue
            row = {**row, "losses": {int(step): loss for step, loss in row["losses"].items()}}
            if len(row["losses"]) >= len(merged.get(row["row"], {}).get("losses", {})):
                merged[row["row"]] = row
    return list(merged.values())


def compare_losses(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each reference present (FSDP alone), every other row of its group step by step on the steps both
    have: max and mean |Δloss|; the repeat's max is the bf16 run-to-run spread, and CP2 passes when its max
    |Δloss| is at most max(``LOSS_TOLERANCE``, spread) and every row of the group read the same batches."""
    by_name = {row["row"]: row for row in merge_rows([rows])}
    groups = []
    for reference in [ref for ref in LOSS_REFERENCES if ref in by_name]:
        members = [name for name in by_name if loss_group(name) == reference and name != reference]
        batches = {(by_name[name].get("tokens_digest"), by_name[name].get("seq_len"), by_name[name].get("world_size"))
                   for name in [reference, *members]}  # fmt: skip
        gaps = {name: loss_gaps(by_name[name]["losses"], by_name[reference]["losses"]) for name in members}
        spread = gaps.get(f"{reference}-repeat", {}).get("max_abs_gap")
        tolerance = max(LOSS_TOLERANCE, spread or 0.0)
        cp2 = gaps.get(f"{reference}-cp2", {}).get("max_abs_gap")
        groups.append({
            "reference": reference, "same_batches": len(batches) == 1, "spread_max_abs": spread,
            "tolerance": tolerance, "rows": gaps,
            "cp2_within_tolerance": None if cp2 is None else bool(cp2 <= tolerance and len(batches) == 1),
        })  # fmt: skip
    return groups


def comparison_rows(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``compare_losses``'s result as table rows: one a compared row, the verdict beside its CP2 row."""
    table = []
    for group in groups:
        for name, gaps in group["rows"].items():
            verdict = group["cp2_within_tolerance"] if name.endswith("-cp2") else None
            table.append({"row": f"{name} against {group['reference']}", **gaps, "same_batches": group["same_batches"],
                          "tolerance": group["tolerance"], "within_tolerance": verdict})  # fmt: skip
    return table


def plot_losses(rows: list[dict[str, Any]], path: str) -> None:
    """For each reference: its group's loss curves (top) and their differences from FSDP alone (bottom); with
    several groups, one PNG each (``<path stem>_<reference>.png``)."""
    rows = merge_rows([rows])
    references = [ref for ref in LOSS_REFERENCES if any(row["row"] == ref for row in rows)]
    if not references:
        print(f"no plot: none of {', '.join(LOSS_REFERENCES)} has losses", flush=True)
    for reference in references:
        curves = {row["row"]: row["losses"] for row in rows if loss_group(row["row"]) == reference}
        seq_len = next(row["seq_len"] for row in rows if row["row"] == reference)
        target = Path(path) if len(references) == 1 else Path(path).with_stem(f"{Path(path).stem}_{reference}")
        titles = (f"Llama-3.1-8B shape, {seq_len:,} tokens, 2 GPUs: train loss on the same batches",
                  "difference from FSDP alone")  # fmt: skip
        try:
            plot_against_reference(curves, reference, target, titles)
        except FoundryError as error:  # no matplotlib on this machine: --compare the JSON elsewhere
            print(f"no plot: {error}", flush=True)
            return


def compare_files(paths: list[str], plot: str | None, out: str | None) -> int:
    """``--compare``: line up the loss rows of one or more calls' long_context.json, print and save the verdict."""
    row_lists = [json.loads(Path(path).read_text())["rows"] for path in paths]
    rows = merge_rows(row_lists)
    groups = compare_losses(rows)
    print(markdown_table(comparison_rows(groups)))
    for group in groups:
        verdict = (
            f"CP2 within max({LOSS_TOLERANCE}, spread) = {group['tolerance']:.4g}: {group['cp2_within_tolerance']}"
        )
        print(
            f"{group['reference']}: same batches {group['same_batches']}, spread {group['spread_max_abs']}, {verdict}"
        )
    if out:
        save_json(out, "long_context_loss", [*rows, *comparison_rows(groups)])
    if plot:
        plot_losses(rows, plot)
    return 0 if groups else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_rows = [name for name in ROWS if name not in OPT_IN_ROWS]
    parser.add_argument("--rows", nargs="*", default=default_rows, choices=list(ROWS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=500.0, help="rows that would not fit are skipped")
    parser.add_argument("--loss-steps", type=int, default=20, help="steps of each 8k/16k loss row")
    parser.add_argument("--plot", default=None, help="PNG of the loss rows' curves and differences")
    parser.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                        help="only compare the loss rows of these calls' long_context.json, and --plot")  # fmt: skip
    parser.add_argument("--prepare", default=None, metavar="NPY", help="only write the token file --tokens reads")
    parser.add_argument("--prepare-tokens", type=int, default=2 * 8192 * 200, help="tokens --prepare writes")
    parser.add_argument("--shared-data", default=str(SHARED_DATA), help="--prepare's text (corpus/, icl/)")
    parser.add_argument("--tokens", default=None, help="the token stream (a .npy --prepare wrote) instead of --corpus")
    parser.add_argument("--corpus", default=str(SHARED_DATA / "corpus"))
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "tokenizers" / "gpt-neox-20b"))
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU ranks: checks the script runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set on the torchrun ranks
    args = parser.parse_args()
    if args.compare:
        return compare_files(args.compare, args.plot, args.out)
    if args.prepare:
        print(prepare_tokens(Path(args.prepare), args.prepare_tokens, Path(args.shared_data), Path(args.tokenizer)))
        return 0
    if args.worker:
        worker(args)
        return 0
    worker_args = ["--rows", *args.rows, "--budget-s", str(args.budget_s)]
    worker_args += ["--loss-steps", str(args.loss_steps)] + (["--plot", args.plot] if args.plot else [])
    worker_args += ["--corpus", args.corpus, "--tokenizer", args.tokenizer] + (["--out", args.out] if args.out else [])
    worker_args += ["--tokens", str(Path(args.tokens).resolve())] if args.tokens else []
    worker_args += ["--smoke"] if args.smoke else []
    returncode = run_on_ranks(__file__, args.nproc, worker_args)
    print_report(args.out, "long_context")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
