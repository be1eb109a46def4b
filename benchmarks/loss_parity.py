"""Does the fastest configuration train like the plain eager path? Per-step losses on real text, same seed.

    python benchmarks/loss_parity.py --text input.txt --tokenizer tokenizer.json --steps 200 --out OUT

Trains the YAML's model (default MPT-125M) through the Trainer for ``--steps`` batches of real
text (tokenized with ``tokenizers`` in memory, no MDS conversion), in the same order and from the
same seed, as: ``default`` (the YAML as shipped, with what ``foundry train`` picks on the device: the
compile_config default, loss_fn auto, its fsdp_config on one rank, attn_impl flash), ``eager`` (the
plain path: no compile, the unfused loss, no fsdp_config so an fp32 residual stream, SDPA, amp_bf16,
autograd's own weight-gradient accumulation),
``eager_again`` (the same run repeated: the GPU's own run-to-run nondeterminism) and ``fp32`` (eager
without autocast: the bf16 rounding gap); ``float8`` (the default path with ``algorithms.float8``, on a GPU
with float8 matrix units) and ``float8_rowwise`` (its rowwise recipe) are there to be asked for. Reports the
max and mean absolute per-step loss difference of each against ``eager``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from bench_utils import REPO_ROOT, markdown_table, save_json, yaml_trainer

from foundry import Callback
from foundry.config import load_train_config

PLAIN = [
    "compile_config=false",
    "model.loss_fn=torch_crossentropy",
    "model.attn_config.attn_impl=sdpa",
    "fsdp_config=null",
    "fuse_weight_grad_accumulation=false",
]
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # the default path with SDPA's cuDNN kernel in place of FlashAttention-4 (where foundry[flash] is installed)
    "default_cudnn": {"overrides": ["model.attn_config.attn_impl=cudnn"]},
    "float8": {"overrides": ["algorithms.float8={}"]},  # the default path with float8 linear layers (Hopper)
    "float8_rowwise": {"overrides": ["algorithms.float8={recipe: rowwise}"]},  # one scale per row
    "eager": {"overrides": PLAIN},
    "eager_again": {"overrides": PLAIN},
    "fp32": {"precision": "fp32", "overrides": PLAIN},
}


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.loss.detach().float().clone())


def text_batches(text_path: str, tokenizer_path: str, steps: int, batch_size: int, seq_len: int) -> list[dict]:
    """``steps`` batches of consecutive ``seq_len``-token windows, cycling over the text in order."""
    from tokenizers import Tokenizer

    with open(text_path, encoding="utf-8") as file:
        ids = Tokenizer.from_file(tokenizer_path).encode(file.read()).ids
    windows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    order = torch.arange(steps * batch_size) % len(windows)
    return [{"input_ids": windows[order[i : i + batch_size]]} for i in range(0, len(order), batch_size)]


def train(config: str, variant: dict[str, Any], batches: list[dict], microbatch: int) -> list[float]:
    cfg, _ = load_train_config(REPO_ROOT / config, variant.get("overrides", []))
    torch.manual_seed(cfg.seed)
    losses = StepLosses()
    trainer = yaml_trainer(cfg, batches, microbatch, [losses], precision=variant.get("precision", cfg.precision))
    trainer.fit()
    torch._dynamo.reset()
    return [loss.item() for loss in losses.losses]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="yamls/pretrain/mpt-125m.yaml")
    parser.add_argument("--text", required=True)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (gpt-neox-20b's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument(
        "--variants", nargs="+", default=["eager", "default", "eager_again", "fp32"], choices=list(VARIANTS)
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg, _ = load_train_config(REPO_ROOT / args.config)
    batches = text_batches(args.text, args.tokenizer, args.steps, args.batch_size, cfg.max_seq_len)
    curves = {}
    for name in args.variants:  # saved after each variant: a failure later keeps the curves so far
        curves[name] = train(args.config, VARIANTS[name], batches, args.microbatch)
        save_json(args.out, "loss_parity", [{"curves": curves}])
    reference = curves["eager"]
    rows = []
    for name, curve in curves.items():
        diffs = [abs(a - b) for a, b in zip(curve, reference)]
        rows.append({
            "variant": name,
            "first_loss": curve[0],
            "last_loss": curve[-1],
            "max_abs_diff_vs_eager": max(diffs),
            "mean_abs_diff_vs_eager": sum(diffs) / len(diffs),
            "mean_abs_diff_last_50": sum(diffs[-50:]) / len(diffs[-50:]),
        })  # fmt: skip
    save_json(args.out, "loss_parity", [*rows, {"curves": curves}])
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
