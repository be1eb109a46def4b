"""What Adam's moments in bf16 (``optimizer.moments_dtype: bfloat16``) cost in loss: the same run twice.

    python benchmarks/bf16_moments.py --steps 300 --out OUT      # a small Llama on real text; a CPU is enough

Both runs train the same small Llama (seeded alike) on the same batches of tokenized text with
``decoupled_adamw``, fp32 moments and bf16 moments, and record every step's loss; the JSON holds both
curves, the largest per-step difference and the mean difference over the last 50 steps. A third run
with fp32 moments and another data order gives the spread that the order alone causes, for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_utils import SHARED_DATA, save_json

from foundry.core import LoggerDestination
from foundry.models.llama import LlamaCausalLM
from foundry.optim import CosineWithWarmupScheduler, DecoupledAdamW
from foundry.trainer import Trainer

MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 8, "kv_n_heads": 2, "vocab_size": 50304, "max_seq_len": 256,
         "ffn_hidden_size": 768, "rope_theta": 10000.0, "tie_word_embeddings": True}  # fmt: skip


class Losses(LoggerDestination):
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        if "loss/train/total" in metrics:
            self.by_step[step] = float(metrics["loss/train/total"])


def batches(args: argparse.Namespace, order_seed: int) -> list[dict[str, torch.Tensor]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "\n\n".join(path.read_text() for path in sorted(Path(args.corpus).rglob("*.txt")))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]) % args.vocab_size
    samples = ids[: ids.numel() // args.seq_len * args.seq_len].view(-1, args.seq_len)
    order = torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(order_seed))
    needed = args.steps * args.batch_size
    return [{"input_ids": samples[order[i : i + args.batch_size]]} for i in range(0, needed, args.batch_size)]


def run(args: argparse.Namespace, moments_dtype: str, order_seed: int) -> dict[int, float]:
    losses = Losses()
    torch.manual_seed(17)
    trainer = Trainer(
        model=LlamaCausalLM(**{**MODEL, "vocab_size": args.vocab_size, "d_model": args.d_model}),
        train_dataloader=batches(args, order_seed),
        max_duration=f"{args.steps}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=2e-3, weight_decay=1e-4, moments_dtype=moments_dtype),
        schedulers=CosineWithWarmupScheduler(t_warmup="20ba", alpha_f=0.1),
        device=args.device,
        precision="amp_bf16" if args.device == "cuda" else "fp32",
        seed=17,
        loggers=[losses],
        log_to_console=False,
        run_folder=f"/tmp/foundry-bf16-moments-{moments_dtype}-{order_seed}",
    )
    trainer.fit()
    return losses.by_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=MODEL["vocab_size"], help="token ids taken modulo this")
    parser.add_argument("--d-model", type=int, default=MODEL["d_model"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--corpus", default=str(SHARED_DATA / "corpus"))
    parser.add_argument("--tokenizer", default=str(SHARED_DATA / "tokenizers" / "gpt-neox-20b"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fp32, bf16, reordered = run(args, "float32", 0), run(args, "bfloat16", 0), run(args, "float32", 1)
    steps = sorted(fp32)
    last = steps[-50:]
    row = {
        "model": {**MODEL, "vocab_size": args.vocab_size, "d_model": args.d_model},
        "steps": args.steps,
        "tokens_per_step": args.batch_size * args.seq_len,
        "device": args.device,
        "max_abs_loss_difference": max(abs(bf16[s] - fp32[s]) for s in steps),
        "mean_loss_difference_last_50": sum(bf16[s] - fp32[s] for s in last) / len(last),
        "mean_abs_loss_difference_last_50_other_data_order": sum(abs(reordered[s] - fp32[s]) for s in last) / len(last),
        "final_loss_fp32_moments": fp32[steps[-1]],
        "final_loss_bf16_moments": bf16[steps[-1]],
        "losses": {"fp32_moments": fp32, "bf16_moments": bf16, "fp32_moments_other_order": reordered},
    }
    save_json(args.out, "bf16_moments", [row])
    print({key: value for key, value in row.items() if key != "losses"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
