"""Packed-sequence training with document masking: FlexAttention vs a dense mask vs no mask.

    python benchmarks/masked_attention.py --text input.txt --tokenizer tokenizer.json --out OUT

Speed rows: each config (MPT-125M, MPT-1B, seq 2048) trains through the Trainer on random tokens
packed as 8 documents a row (``sequence_id``), as:

- ``unmasked``: ``attn_uses_sequence_id: false``: plain causal attention over the packed row (the
  speed to match; documents see each other, as in pretraining);
- ``dense``: ``attn_impl: sdpa`` with document masking: a ``(batch, 1, seq, seq)`` mask, SDPA's
  mask-capable kernel;
- ``flex``: ``attn_impl: flash`` with document masking: FlexAttention's block mask;
- ``alibi_dense`` / ``alibi_flex`` (asked for by name): ALiBi on one document a row, SDPA with a dense
  bias against FlexAttention's score modifier.

Each block compiled (``compile_config: {scope: blocks}``, which compiles faster than the whole model
and is the same for all three), amp_bf16, the YAML's optimizer; step time from CUDA events at
BATCH_END; peak memory of the run.

Loss rows: MPT-125M on real text (``--text``, packed with fake document boundaries every 256-768
tokens) for ``--steps`` batches, ``flex`` against ``dense`` and ``dense`` repeated (the GPU's own noise).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch
from bench_utils import REPO_ROOT, markdown_table, save_json, yaml_trainer
from profile_summary import recorded_event

from foundry import Callback
from foundry.config import load_train_config

CONFIGS = {"mpt-125m": ("yamls/pretrain/mpt-125m.yaml", 16), "mpt-1b": ("yamls/pretrain/mpt-1b.yaml", 4)}
VARIANTS = {
    "unmasked": ["model.attn_config.attn_uses_sequence_id=false", "model.attn_config.attn_impl=flash"],
    "dense": ["model.attn_config.attn_uses_sequence_id=true", "model.attn_config.attn_impl=sdpa"],
    "flex": ["model.attn_config.attn_uses_sequence_id=true", "model.attn_config.attn_impl=flash"],
    # ALiBi, one document a row: a (1, heads, seq, seq) bias for SDPA, a score modifier for FlexAttention
    "alibi_dense": ["model.attn_config.alibi=true", "model.learned_pos_emb=false", "model.attn_config.attn_impl=sdpa"],
    "alibi_flex": ["model.attn_config.alibi=true", "model.learned_pos_emb=false", "model.attn_config.attn_impl=flash"],
}
COMMON = ["compile_config={scope: blocks}", "model.init_device=cpu"]


class StepEvents(Callback):
    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []
        self.losses: list[torch.Tensor] = []

    def batch_end(self, state, logger) -> None:
        self.events.append(recorded_event())
        self.losses.append(state.loss.detach().float().clone())


def packed_sequence_ids(rows: int, seq_len: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, seq_len) document index of each token: ``documents`` random-length documents a row."""
    cuts = torch.sort(torch.randperm(seq_len - 1, generator=generator)[: documents - 1] + 1).values
    ids = torch.zeros(seq_len, dtype=torch.long)
    for cut in cuts:
        ids[cut:] += 1
    return ids.expand(rows, seq_len).clone()


def random_packed_batches(count: int, batch_size: int, seq_len: int, vocab_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).pin_memory(),
            "sequence_id": packed_sequence_ids(batch_size, seq_len, 8, generator).pin_memory(),
        }
        for _ in range(count)
    ]


def text_packed_batches(text: str, tokenizer: str, steps: int, batch_size: int, seq_len: int) -> list[dict]:
    """Consecutive windows of real text, cut into documents of 256-768 tokens (the same cuts for every run)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(tokenizer).encode(Path(text).read_text(encoding="utf-8")).ids
    windows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        rows = windows[(torch.arange(batch_size) + step * batch_size) % len(windows)]
        bounds = torch.randint(256, 769, (seq_len // 256,), generator=generator).cumsum(0)
        sequence_id = (torch.arange(seq_len)[:, None] >= bounds[None, :]).sum(1).expand(batch_size, -1).clone()
        batches.append({"input_ids": rows, "sequence_id": sequence_id})
    return batches


def train(config: str, variant: str, batches: list[dict], microbatch: int) -> tuple[StepEvents, float]:
    cfg, _ = load_train_config(REPO_ROOT / config, [*COMMON, *VARIANTS[variant]])
    torch.manual_seed(cfg.seed)
    events = StepEvents()
    torch.cuda.reset_peak_memory_stats()
    trainer = yaml_trainer(cfg, batches, microbatch, [events], schedulers=None)
    trainer.fit()
    torch.cuda.synchronize()
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return events, peak_gib


def speed_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in args.configs:
        config, microbatch = CONFIGS[name]
        batch_size = microbatch * args.accum
        batches = random_packed_batches(args.warmup + args.steps, batch_size, 2048, 50368)
        for variant in args.variants:
            started_s = time.perf_counter()
            events, peak_gib = train(config, variant, batches, microbatch)
            step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(events.events[args.warmup - 1 :])]
            mean_ms = sum(step_ms) / len(step_ms)
            rows.append({"config": name, "variant": variant, "microbatch": microbatch, "step_ms": mean_ms,
                         "tokens_per_s": batch_size * 2048 / mean_ms * 1e3, "peak_gib": peak_gib,
                         "wall_s": time.perf_counter() - started_s})  # fmt: skip
            unmasked = next((r for r in rows if r["config"] == name and r["variant"] == "unmasked"), None)
            if unmasked:
                rows[-1]["vs_unmasked"] = rows[-1]["tokens_per_s"] / unmasked["tokens_per_s"]
            print(rows[-1], flush=True)
            save_json(args.out, "masked_attention", rows)
    return rows


def loss_rows(args: argparse.Namespace) -> dict:
    batches = text_packed_batches(args.text, args.tokenizer, args.loss_steps, 4, 2048)
    curves = {}
    for name, variant in (("dense", "dense"), ("flex", "flex"), ("dense_again", "dense")):
        events, _ = train(CONFIGS["mpt-125m"][0], variant, batches, 4)
        curves[name] = [loss.item() for loss in events.losses]
    summary = []
    for name, curve in curves.items():
        diffs = [abs(a - b) for a, b in zip(curve, curves["dense"])]
        summary.append({"variant": name, "last_loss": curve[-1], "max_abs_diff_vs_dense": max(diffs),
                        "mean_abs_diff_vs_dense": sum(diffs) / len(diffs)})  # fmt: skip
    return {"summary": summary, "curves": curves}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--variants", nargs="+", default=["unmasked", "dense", "flex"], choices=list(VARIANTS))
    parser.add_argument("--accum", type=int, default=8, help="microbatches a batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--text", help="text for the loss rows (skipped without it)")
    parser.add_argument("--tokenizer", help="a tokenizer.json (gpt-neox-20b's)")
    parser.add_argument("--loss-steps", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("masked_attention.py needs a CUDA device.", file=sys.stderr)
        return 2
    rows = speed_rows(args)
    print(markdown_table(rows))
    if args.text:
        losses = loss_rows(args)
        save_json(args.out, "masked_attention", [*rows, {"loss": losses}])
        print(markdown_table(losses["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
